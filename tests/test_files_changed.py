"""Files changed on disk while a session runs: a DiT, LoRA, text encoder, VAE or Fun ControlNet file replaced under
the same name between two prompts is what the next prompt runs; one removed or truncated gives a clear error naming
it, and putting it back gives a clean run.

ComfyUI's default node cache reruns a node only when its inputs or its `fingerprint_inputs` (IS_CHANGED) change;
`NodeCache` below does the same in process, so these tests see what a server with its default cache sees. The
pack's own caches (the kept prefix store, the text encoder's prompt cache) hang off the loaded objects, so a
loader that runs again leaves them nothing stale to serve: checked through keep_cache runs.
"""

import json
import os
import shutil

import pytest
import torch

import graph_fixtures as gf
from qi21.demo import tiny_checkpoints as tiny
from qi21.model.loaders.checkpoint import CheckpointError
from qi21.nodes import bridge
from qi21.nodes.conditioning import QI21TextEncode
from qi21.nodes.controlnet import QI21ControlNetLoader
from qi21.nodes.decode import QI21VAEDecode
from qi21.nodes.loaders import QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader
from qi21.nodes.lora import QI21LoraLoader
from qi21.nodes.placement import KEPT_CACHES
from qi21.nodes.samplers import QI21Sampler

#: component -> (folder, file name, loader node, its constant inputs besides the name)
COMPONENTS = {
    "dit": ("diffusion_models", tiny.DIT_FILE, QI21ModelLoader, {"weight_dtype": "fp32"}),
    "lora": ("loras", tiny.SPEED_LORA_FILE, QI21LoraLoader, {"strength": 0.8}),
    "text_encoder": ("text_encoders", tiny.TEXT_ENCODER_FILE, QI21TextEncoderLoader, {"weight_dtype": "fp32"}),
    "vae": ("vae", tiny.VAE_FILE, QI21VAELoader, {"weight_dtype": "fp32"}),
    "controlnet": ("model_patches", tiny.CONTROLNET_FILE, QI21ControlNetLoader, {"weight_dtype": "fp32"}),
}
NAME_INPUT = {QI21ModelLoader: "model_name", QI21LoraLoader: "lora_name", QI21TextEncoderLoader: "text_encoder_name",
              QI21VAELoader: "vae_name", QI21ControlNetLoader: "control_net_name"}


class NodeCache:
    """ComfyUI's default cache in miniature: a node's output is reused while its constant inputs, the identity of
    its linked inputs and its `fingerprint_inputs` are unchanged."""

    def __init__(self):
        self.outputs, self.runs = {}, 0

    def __call__(self, node, **inputs):
        constants = {k: v for k, v in inputs.items() if isinstance(v, (str, int, float, bool))}
        links = tuple(sorted((k, id(v)) for k, v in inputs.items() if k not in constants))
        key = (node.__name__, json.dumps(constants, sort_keys=True), links, node.fingerprint_inputs(**constants))
        if key not in self.outputs:
            self.runs += 1
            self.outputs[key] = node.execute(**inputs)
        return self.outputs[key]


@pytest.fixture(scope="module")
def new_files(tmp_path_factory):
    """Another tiny set (other seed): the same names and shapes, other weights."""
    return tiny.write_tiny_checkpoints(tmp_path_factory.mktemp("new_models"), seed=7)["root"]


@pytest.fixture
def root(tiny_models, tmp_path):
    """A private copy of the tiny set as the models folder (these tests change its files)."""
    copy = tmp_path / "models"
    shutil.copytree(tiny_models["root"], copy, ignore=shutil.ignore_patterns("diffusers"))
    bridge.set_models_root(copy)
    KEPT_CACHES.clear()
    yield copy
    KEPT_CACHES.clear()
    bridge.set_models_root(None)


def _path(root, component):
    folder, name, _, _ = COMPONENTS[component]
    return root / folder / name


def _fingerprint(component):
    folder, name, node, _ = COMPONENTS[component]
    return node.fingerprint_inputs(**{NAME_INPUT[node]: name})


def replace(root, new_files, component, keep_time: bool = False) -> None:
    """The file replaced by the other set's (same name and size); `keep_time`: with its old mtime (`cp -p`)."""
    path = _path(root, component)
    before = path.stat()
    shutil.copyfile(_path(new_files, component), path)
    if keep_time:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns


@pytest.mark.parametrize("component", list(COMPONENTS))
@pytest.mark.parametrize("keep_time", [False, True], ids=["new-mtime", "same-size-and-mtime"])
def test_the_fingerprint_is_stable_and_follows_the_file(root, new_files, component, keep_time):
    first = _fingerprint(component)
    assert first == _fingerprint(component) and first.startswith(str(_path(root, component).stat().st_size))
    replace(root, new_files, component, keep_time)
    assert _fingerprint(component) != first  # the digest tells them apart even at the same size and time


def _sample(model, positive, keep=True):
    out = QI21Sampler.execute(model, positive, 3, 2, 1.0, 64, 64, 1, keep_cache=keep)
    return out[0]["samples"], out.ui["qi21_report"][0]


def _graph(cache, lora: bool):
    """DiT (and LoRA) through the node cache, with a fixed synthetic prompt (no text encoder needed)."""
    folder, name, node, extra = COMPONENTS["dit"]
    model = cache(QI21ModelLoader, model_name=name, **extra)[0]
    if lora:
        model = cache(QI21LoraLoader, model=model, lora_name=COMPONENTS["lora"][1], **COMPONENTS["lora"][3])[0]
    return model


@pytest.mark.parametrize("component", ["dit", "lora"])
def test_a_replaced_dit_or_lora_is_what_the_next_prompt_runs_and_no_kept_cache_serves_the_old(root, new_files,
                                                                                               component):
    cache, positive = NodeCache(), gf.synthetic_conditioning(text_runs=[10])
    lora = component == "lora"
    old, first = _sample(_graph(cache, lora), positive)
    again, second = _sample(_graph(cache, lora), positive)
    assert first["cache"] == "miss" and second["cache"] == "hit" and torch.equal(old, again)  # cached, kept
    runs = cache.runs
    replace(root, new_files, component)
    new, report = _sample(_graph(cache, lora), positive)
    assert cache.runs == runs + 1  # the loader (only it: the DiT under a LoRA is unchanged) ran again
    assert report["cache"] == "miss"  # the old weights' kept prefix is not served to the new ones
    fresh, _ = _sample(_graph(NodeCache(), lora), positive, keep=False)  # the same prompt alone, nothing cached
    assert torch.equal(new, fresh) and not torch.allclose(new, old)
    clean, report = _sample(_graph(cache, lora), positive)
    assert report["cache"] == "hit" and torch.equal(clean, new)


def _encoder_vae_net(cache):
    """A prompt's text states (encoded twice: the second from the encoder's prompt cache), a decoded latent and the
    control net's weights, with the loaders through `cache`."""
    encoder = cache(QI21TextEncoderLoader, text_encoder_name=tiny.TEXT_ENCODER_FILE, weight_dtype="fp32")[0]
    QI21TextEncode.execute(encoder, "a red bicycle", None)
    text = QI21TextEncode.execute(encoder, "a red bicycle", None)[0].text
    vae = cache(QI21VAELoader, vae_name=tiny.VAE_FILE, weight_dtype="fp32")[0]
    latent = {"samples": torch.linspace(-1, 1, 64 * 4 * 4).reshape(1, 64, 4, 4)}
    image = QI21VAEDecode.execute(vae, latent)[0]
    net = cache(QI21ControlNetLoader, control_net_name=tiny.CONTROLNET_FILE, weight_dtype="fp32")[0]
    return text, image, torch.cat([p.detach().flatten() for p in net.parameters()])


def test_a_replaced_text_encoder_vae_or_controlnet_is_loaded_again(root, new_files):
    cache = NodeCache()
    old = _encoder_vae_net(cache)
    assert all(torch.equal(a, b) for a, b in zip(old, _encoder_vae_net(cache))) and cache.runs == 3  # cached
    for component in ("text_encoder", "vae", "controlnet"):
        replace(root, new_files, component, keep_time=True)  # the hardest case: same size and mtime
    new = _encoder_vae_net(cache)
    assert cache.runs == 6
    bridge.set_models_root(new_files)  # the new files loaded alone, in a cache of their own
    alone = _encoder_vae_net(NodeCache())
    for a, b, fresh in zip(new, old, alone):
        assert torch.equal(a, fresh) and a.shape == b.shape and not torch.equal(a, b)


@pytest.mark.parametrize("component", list(COMPONENTS))
@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_a_file_removed_or_truncated_after_loading_is_named_on_the_next_load_then_a_clean_run(root, component,
                                                                                             damage):
    folder, name, node, extra = COMPONENTS[component]
    path = _path(root, component)
    base = {"model": gf.load("model")["model"]} if component == "lora" else {}
    inputs = {**base, NAME_INPUT[node]: name, **extra}
    cache = NodeCache()
    cache(node, **inputs)
    data, before = path.read_bytes(), _fingerprint(component)
    if damage == "removed":
        path.unlink()
        expected = (ValueError, f"{name!r} is not in the {folder} folders")
    else:
        path.write_bytes(data[: len(data) // 2])
        expected = (CheckpointError, "is truncated")
    assert _fingerprint(component) != before  # so ComfyUI's cache runs the loader again
    with pytest.raises(expected[0]) as error:
        cache(node, **inputs)
    assert expected[1] in str(error.value) and name in str(error.value)
    if damage == "removed":
        assert node.validate_inputs(**{NAME_INPUT[node]: name}) is not True  # queueing it again is refused too
    path.write_bytes(data)  # put back: a clean run
    loaded = cache(node, **inputs)[0]
    assert loaded is not None and _fingerprint(component).split(":")[0] == str(len(data))
