"""ComfyUI's own samplers over our model (the samplers' `sampler` input), against a real ComfyUI.

tests/comfyui/sampler_check.py runs under ComfyUI's interpreter (QI21_COMFYUI, QI21_COMFYUI_PYTHON; skipped without
them): KSamplerSelect's SAMPLER objects through nodes/comfy_sampling.py over our tiny DiT, against the same SAMPLER
over diffusers' transformer as the denoiser (same weights, conditioning, noise and seed, the model_sampling built
from ComfyUI's own flux-style CONST class)."""

import json
import os
import subprocess
from pathlib import Path

import diffusers
import pytest

from qi21_comfy_harness import configured_comfyui  # tests/comfyui/, on sys.path through pyproject's `pythonpath`

CHECK = Path(__file__).resolve().parent / "comfyui" / "sampler_check.py"
ORACLE_TOL, EULER_TOL, CACHE_OFF_TOL = 1e-4, 1e-5, 5e-4


@pytest.fixture(scope="module")
def results():
    comfyui, python = configured_comfyui()
    oracle_site = str(Path(diffusers.__file__).resolve().parents[1])
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([python, str(CHECK), str(comfyui), oracle_site], capture_output=True, text=True,
                          timeout=600, cwd=CHECK.parent, env=env)
    line = next((row for row in done.stdout.splitlines() if row.startswith("QI21_RESULT ")), None)
    assert done.returncode == 0 and line, f"sampler_check.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(line[len("QI21_RESULT "):])


def test_ksamplerselect_euler_equals_the_builtin_euler(results):
    case = results["euler_vs_builtin"]
    assert case["diff"] <= EULER_TOL
    assert case["report"]["model_calls"] == 8 and case["report"]["steps"] == 8


@pytest.mark.parametrize("case", ["dpmpp_2m_cfg1", "res_multistep_cfg1", "heun_cfg1", "euler_ancestral_cfg1",
                                  "er_sde_cfg1", "uni_pc_cfg1", "euler_cfg_pp_cfg1", "dpmpp_2m_cfg3", "turbo_heun"])
def test_comfyui_sampler_equals_it_over_diffusers(results, case):
    assert results[case]["diff"] <= ORACLE_TOL


@pytest.mark.parametrize("case", ["dpmpp_2m_cfg1", "heun_cfg1", "er_sde_cfg1", "uni_pc_cfg1", "dpmpp_2m_cfg3"])
def test_the_cache_is_filled_once_and_off_changes_nothing(results, case):
    entry = results[case]
    calls = entry["report"]["model_calls"]
    # one forward per model call (CFG's two prompts batched), the first the prefill, every later one cached
    assert entry["modes"] == ["prefill"] + ["cached"] * (calls - 1)
    assert entry["report"]["cache"] == "miss" and entry["report"]["prefill_seconds"] is not None
    assert entry["cache_off_modes"] == ["uncached"] * calls
    assert entry["cache_off_diff"] <= CACHE_OFF_TOL


def test_two_model_calls_per_step_share_the_cache(results):
    # heun: two calls per step but the last (to sigma 0): 15 calls for 8 steps, one prefill
    assert results["heun_cfg1"]["report"]["model_calls"] == 15
    assert results["turbo_heun"]["modes"].count("prefill") == 1


def test_scheduler_names_equal_comfyuis_own(results):
    from qi21.model.sampling.flow_schedulers import COMFY_SCHEDULERS

    entry = results["schedulers"]
    assert tuple(entry["names"]) == COMFY_SCHEDULERS
    assert entry["shape_mismatches"] == [] and entry["worst"] <= 1e-6
