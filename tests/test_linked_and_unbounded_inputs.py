"""Inputs that arrive through links, and text-encoder work without a bound.

- ComfyUI validates a prompt before it runs, when a linked input has no value yet: `validate_inputs` receives None
  for it (`execution.py`, `get_input_data` marks it missing). A validator that compares None (`None < 1`) or looks
  None up in a file list refuses every graph that feeds a widget from a primitive or a switch. The value is
  checked when the node runs instead, with the same message, and a file name must then be one the loader lists
  (nothing outside the model folders).
- The text encoder ran any prompt to the end: a 100,000-character prompt became a 23,500-token prefix (about
  11.5 GiB of prefix cache at full size) and Cancel waited for all 36 layers. Prompts and reference sets beyond
  the DiT's RoPE positions are now refused before the encoder moves, and Cancel stops between layers and vision
  blocks. The limit is injected small here, so the tiny model shows it in milliseconds.
"""

import pytest
import torch
from PIL import Image

import graph_fixtures as gf
from qi21.model.encoders.pipeline import encode_prompt
from qi21.model.encoders.prompt_template import MAX_ROPE_POSITIONS, rope_positions
from qi21.model.sampling.loop import initial_noise
from qi21.nodes import NODES, bridge, placement
from qi21.nodes.conditioning import QI21Reference, QI21TextEncode
from qi21.nodes.decode import QI21VAEDecode
from qi21.nodes.loaders import QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader
from qi21.nodes.samplers import QI21Sampler, QI21TurboSampler

LOADERS = [(QI21ModelLoader, "model_name", "diffusion_models", gf.SINGLE["model"]),
           (QI21TextEncoderLoader, "text_encoder_name", "text_encoders", gf.SINGLE["text_encoder"]),
           (QI21VAELoader, "vae_name", "vae", gf.SINGLE["vae"])]
#: Names that resolved to a real file or folder through `..` before names were checked at execution.
ESCAPING = {"diffusion_models": f"../diffusion_models/{gf.SINGLE['model']}",
            "text_encoders": f"../text_encoders/{gf.SINGLE['text_encoder']}",
            "vae": f"../vae/{gf.SINGLE['vae']}"}


@pytest.fixture(scope="module")
def loaded(models_root):
    return gf.load("text_encoder", "vae")


@pytest.fixture
def encoder(loaded):
    """The tiny text encoder; its position limit and the interrupt flag are restored after each test."""
    text_encoder = loaded["text_encoder"]
    limit = text_encoder.max_positions
    yield text_encoder
    text_encoder.max_positions = limit
    try:  # a pending Cancel must not leak into the next test (the old encoder never consumed it)
        bridge.throw_if_interrupted()
    except InterruptedError:
        pass


def image(width=256, height=256, seed=0):
    return torch.rand(1, height, width, 3, generator=torch.Generator().manual_seed(seed))


# -- linked widgets: None at validation, checked at execution -------------------------------------------------------
def all_linked(node) -> dict:
    """What ComfyUI hands a `**kwargs` validator when every input of the node comes through a link."""
    return {spec.id: None for spec in node.define_schema().inputs}


@pytest.mark.parametrize("node", [n for n in NODES if "validate_inputs" in vars(n)], ids=lambda n: n.__name__)
def test_every_validator_leaves_linked_inputs_to_execution(models_root, node):
    assert node.validate_inputs(**all_linked(node)) is True


def test_a_linked_widget_does_not_hide_the_others():
    linked_steps = dict(all_linked(QI21Sampler), width=8192, height=0)
    assert "width = 8192" in QI21Sampler.validate_inputs(**linked_steps)
    assert "cfg = 0.5" in QI21Sampler.validate_inputs(**dict(all_linked(QI21Sampler), cfg=0.5))
    assert QI21TurboSampler.validate_inputs(**dict(all_linked(QI21TurboSampler), width=512)) is True


def test_values_that_arrive_through_links_are_checked_when_the_node_runs(loaded):
    with pytest.raises(ValueError, match=r"steps = 0: at least 1 step"):
        QI21Sampler.execute(None, None, seed=0, steps=0, cfg=1.0, width=0, height=0, batch_size=1)
    with pytest.raises(ValueError, match=r"batch_size = 0: expected a value from 1 to 64"):
        QI21TurboSampler.execute(None, None, seed=0, width=0, height=0, batch_size=0)
    with pytest.raises(ValueError, match=r"resolution = 5000: expected a value from 0 to 4096"):
        QI21Reference.execute(loaded["vae"], image(), 5000)
    with pytest.raises(ValueError, match=r"tiled = 'sometimes': expected one of auto, on, off"):
        QI21VAEDecode.execute(loaded["vae"], {"samples": torch.zeros(1, 64, 4, 4)}, tiled="sometimes")
    with pytest.raises(ValueError, match=r"needs a prompt string; got NoneType"):
        QI21TextEncode.execute(loaded["text_encoder"], None)


def test_a_batch_draws_its_noise_as_the_batch_size_tooltip_says():
    """One CPU generator per run: image 1 starts from the batch-1 noise of the seed, image b from the next draws."""
    batch = initial_noise(7, 3, 256, 256)
    generator = torch.Generator("cpu").manual_seed(7)
    draws = torch.cat([torch.randn(1, 64, 16, 16, generator=generator) for _ in range(3)])
    torch.testing.assert_close(batch, draws, rtol=0, atol=0)
    torch.testing.assert_close(batch[:1], initial_noise(7, 1, 256, 256), rtol=0, atol=0)
    assert not torch.equal(batch[1], initial_noise(8, 1, 256, 256)[0])  # not the run with seed + 1
    tooltip = next(i.tooltip for i in QI21Sampler.define_schema().inputs if i.id == "batch_size")
    assert "not from seed + b - 1" in tooltip


# -- linked file names ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("node, name_input, kind, name", LOADERS, ids=lambda v: getattr(v, "__name__", None))
def test_a_linked_file_name_is_accepted_while_validating_and_checked_when_known(models_root, node, name_input, kind,
                                                                                  name):
    assert node.validate_inputs(**{name_input: None, "weight_dtype": "fp32"}) is True
    assert node.validate_inputs(**{name_input: name, "weight_dtype": "fp32"}) is True  # known: checked as before
    assert "not in the" in node.validate_inputs(**{name_input: "missing.safetensors", "weight_dtype": "fp32"})


@pytest.mark.parametrize("node, name_input, kind, name", LOADERS, ids=lambda v: getattr(v, "__name__", None))
def test_execute_refuses_unknown_and_escaping_names_with_the_validation_message(models_root, monkeypatch, node,
                                                                                 name_input, kind, name):
    def resolved(*args):
        raise AssertionError("the name was resolved to a path before it was checked")

    monkeypatch.setattr(bridge, "model_path", resolved)
    for bad in ("missing.safetensors", ESCAPING[kind], "diffusers/../diffusers/Qwen-Image-2.1", None):
        expected = f"{bad!r} is not in the {kind} folders; pick a listed file or refresh (R) after copying it there."
        if bad is not None:
            assert node.validate_inputs(**{name_input: bad, "weight_dtype": "fp32"}) == expected
        with pytest.raises(ValueError) as error:
            node.execute(bad, "fp32")
        assert str(error.value) == expected


def test_execute_rechecks_the_loader_widgets(models_root):
    with pytest.raises(ValueError, match=r"weight_dtype = 'fp4': expected one of default, bf16, fp16, fp32"):
        QI21ModelLoader.execute(gf.SINGLE["model"], "fp4")
    with pytest.raises(ValueError, match=r"device = 'gpu': expected one of default, cpu"):
        QI21TextEncoderLoader.execute(gf.SINGLE["text_encoder"], "fp32", device="gpu")


# -- the text encoder: a bound on the prompt, and Cancel between layers -------------------------------------------
def test_the_released_limit_is_the_dits_rope_range(encoder):
    assert MAX_ROPE_POSITIONS == 8192 and encoder.max_positions == MAX_ROPE_POSITIONS


def test_a_prompt_beyond_the_position_limit_is_refused_before_the_encoder_moves(encoder, monkeypatch):
    prompt = "a red fox jumps over the lazy dog " * 30
    encoder.max_positions = 40  # the released model's 8192, scaled down for the tiny tokenizer

    def moved(*args, **kwargs):
        raise AssertionError("the text encoder was moved before the prompt was checked")

    monkeypatch.setattr(placement, "on_device", moved)
    hooks = [layer.register_forward_pre_hook(lambda *a: pytest.fail("a decoder layer ran"))
             for layer in encoder.model.language_model.layers]
    try:
        with pytest.raises(ValueError) as error:
            QI21TextEncode.execute(encoder, prompt)
        with pytest.raises(ValueError):
            encoder.encode(prompt)  # the model-side API refuses it too
    finally:
        for hook in hooks:
            hook.remove()
    message = str(error.value)
    for fragment in ("RoPE positions", "at most 40", "diffusers' QwenImage21Rope", "Shorten the prompt by at least"):
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_references_count_toward_the_limit_as_the_dit_lays_them_out(encoder, loaded):
    prompt = "<image1> as a watercolour"
    refs = QI21Reference.execute(loaded["vae"], image(256, 320), 0)[0]  # latent grid 16 x 20: 20 positions
    conditioning = encode_prompt(encoder, prompt, refs)
    text_tokens = int((~conditioning.image_slots).sum())
    needed = rope_positions(text_tokens, conditioning.ref_shapes)
    # the count the encoder checks is the target frame of the DiT's own layout, plus the target itself
    layout = conditioning.layout((8, 8))
    assert needed == int(layout.target_positions[0, 0]) + 1 == text_tokens + 20 + 1
    encoder.max_positions = needed
    encoder.check_prompt(prompt, [r.prepared for r in refs])  # exactly at the limit: fine
    encoder.max_positions = needed - 1
    with pytest.raises(ValueError, match=r"1 reference\(s\) take 20 positions.*at most %d" % (needed - 1)):
        QI21TextEncode.execute(encoder, prompt, refs)
    alone = "as a watercolour"
    assert rope_positions(encode_prompt(encoder, alone).text.shape[0], ()) <= needed - 1
    QI21TextEncode.execute(encoder, alone)  # the same limit without the reference: fine


def test_a_reference_beyond_the_negative_positions_is_refused(encoder):
    wide = Image.new("RGB", (2049 * 16 + 16, 64), (255, 255, 255))  # 2050 latent columns: ids down to -1025
    with pytest.raises(ValueError, match=r"RoPE positions down to -1025, below the -1024 .* at most 32768 pixels"):
        encoder.check_prompt("<image1>", [wide])


def test_cancel_stops_the_vision_tower_and_the_decoder_between_layers(encoder, loaded, monkeypatch):
    refs = QI21Reference.execute(loaded["vae"], image(), 0)[0]
    clean = QI21TextEncode.execute(encoder, "<image1> at night", refs)[0]
    decoder_runs = []

    def watch(module, args, output, where):
        decoder_runs.append(where)
        if where == ("decoder", 0):
            bridge.request_interrupt()  # Cancel pressed while layer 0 ran

    handles = [layer.register_forward_hook(lambda m, a, o, i=i: watch(m, a, o, ("decoder", i)))
               for i, layer in enumerate(encoder.model.language_model.layers)]
    try:
        with pytest.raises(InterruptedError):
            QI21TextEncode.execute(encoder, "<image1> at night", refs)
    finally:
        for handle in handles:
            handle.remove()
    assert decoder_runs == [("decoder", 0)]  # layer 1 never ran

    encoder.prompt_cache.clear()  # the vision tower runs only for a reference the encoder has not kept
    blocks = []
    handle = encoder.model.visual.blocks[0].register_forward_hook(
        lambda *a: blocks.append(0) or bridge.request_interrupt())
    try:
        with pytest.raises(InterruptedError):
            QI21TextEncode.execute(encoder, "<image1> at night", refs)
    finally:
        handle.remove()
    assert blocks == [0]

    # nothing stays behind: no interrupt hooks, and the next encoding equals the one never cancelled
    assert all(not layer._forward_pre_hooks for layer in encoder.model.language_model.layers)
    again = QI21TextEncode.execute(encoder, "<image1> at night", refs)[0]
    torch.testing.assert_close(again.text, clean.text, rtol=0, atol=0)


def test_interruptible_without_a_check_changes_nothing(encoder):
    with encoder.interruptible(None):
        plain = encoder.encode("a cat").embeds
    torch.testing.assert_close(plain, encoder.encode("a cat").embeds, rtol=0, atol=0)
