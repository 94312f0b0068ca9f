"""benchmarks/gpu_check.py, the one-call device script, in its CPU dry run: every section runs, every fast path agrees
with its twin, the output names every path a GPU run times, no GPU figure is made up, and a failing section is
reported while the others still run."""

import pytest


@pytest.fixture(scope="module")
def gpu_check(benchmark_script):
    return benchmark_script("gpu_check")


def test_the_dry_run_reaches_every_path_and_every_path_matches(gpu_check, capsys):
    results = gpu_check.main(["--dry-run"])
    out = capsys.readouterr().out
    assert {name: r["ok"] for name, r in results.items()} == {name: True for name in gpu_check.SECTIONS}, out
    assert all(r["bit_identical"] for r in results["streaming"]["rows"])
    assert {r["cache"]: r["bit_identical"] for r in results["cache"]["rows"]} == {"device": True, "host": True}
    formats = {r["model"]: r for r in results["formats"]["rows"]}
    assert set(formats) == {"diffusers bf16", "bf16 file", "int8_convrot", "fp8", "w4a8", "Q8_0", "Q4_K",
                            "LoRA r32 on the bf16 file"}
    for name, row in formats.items():  # fp32 on a CPU: every format dequantized per layer, equal to its twin
        assert name == "diffusers bf16" or row["rel_diff_vs_twin"] <= 1e-5, (name, row)
    assert all(r["rel_diff_cached"] <= 1e-5 for r in results["bf16"]["rows"])  # fp32: ours == diffusers
    assert [r["measured_gib"] for r in results["planner"]["rows"]] == [None] * 7
    assert [r["phase"] for r in results["planner"]["rows"]] == [
        "prefill", "cached", "decode", "decode 64x64 one pass", "decode 128x128 one pass", "decode 256x256 one pass",
        "decode 256x256 tiled"]
    quant = {(r["references"], r["cache"]): r for r in results["cache_quant"]["rows"]}
    assert set(quant) == {(refs, c) for refs in (1, 2) for c in ("default", "int8", "int4")}
    for refs in (1, 2):  # smaller caches that move the velocity a little, int4 more than int8
        assert quant[refs, "int4"]["bytes"] < quant[refs, "int8"]["bytes"] < quant[refs, "default"]["bytes"]
        assert 0 < quant[refs, "int8"]["rel_diff"] < quant[refs, "int4"]["rel_diff"] < 0.05
    drift = {r["pair"]: r["rel_diff"] for r in results["drift"]["rows"]}
    assert drift["diffusers fp32 vs ours fp32"] <= 1e-5  # the fp32 truth is one number for both
    assert drift["ours bf16 vs ours fp32"] > 1e-3 and drift["diffusers bf16 vs ours fp32"] > 1e-3  # bf16 did run
    assert [r["run"] for r in results["e2e"]["rows"]] == ["Base, 40 steps", "Turbo, 8 steps"]
    assert all(r["finite"] for r in results["e2e"]["rows"])
    host = {r["side"]: r for r in results["host"]["rows"]}
    assert set(host) == {"ours", "diffusers"} and host["ours"]["kernels"] < host["diffusers"]["kernels"]
    assert "host ms to issue" in out
    for name in ("int8_convrot", "fp8", "w4a8", "Q8_0", "Q4_K", "LoRA", "host", "streamed 0/4", "n/a (CPU)"):
        assert name in out, name
    compiled = {r["path"]: r for r in results["compiled"]["rows"]}
    assert set(compiled) == {"ours eager", "diffusers", "compiled", "compiled + CUDA graphs"}
    assert compiled["compiled"]["rel_diff"] <= 1e-5 and compiled["compiled + CUDA graphs"]["rel_diff"] <= 1e-5
    fp8 = {(r["model"], r["mode"]): r for r in results["fp8"]["rows"]}  # fp32 on a CPU, _scaled_mm forced
    assert len(fp8) == 8 and fp8["bf16", "compiled"]["rel_diff"] <= 1e-5
    assert 0 < fp8["fp8_e4m3fn_fast", "eager"]["rel_diff"] < 0.05
    for name in ("fp8_e4m3fn_fast", "int8 ConvRot, comfy-kitchen", "int8 ConvRot, torch._int_mm"):
        assert abs(fp8[name, "compiled"]["rel_diff"] - fp8[name, "eager"]["rel_diff"]) <= 1e-5, name
    assert abs(fp8["int8 ConvRot, torch._int_mm", "eager"]["rel_diff"]
               - fp8["int8 ConvRot, comfy-kitchen", "eager"]["rel_diff"]) <= 1e-4


def test_a_failing_section_is_reported_and_the_others_still_run(gpu_check, monkeypatch, capsys):
    def broken(check):
        raise RuntimeError("out of device memory (simulated)")

    monkeypatch.setitem(gpu_check.RUNNERS, "planner", broken)
    results = gpu_check.main(["--dry-run", "--sections", "planner", "cache"])
    out = capsys.readouterr().out
    assert results["planner"] == {"ok": False, "error": "RuntimeError: out of device memory (simulated)",
                                  "seconds": results["planner"]["seconds"]}
    assert results["cache"]["ok"] and "### planner: FAILED" in out and "failed sections: planner" in out
