"""GGUF DiT files: our dequantization against the gguf package's reference, the loaded model against the same model
built from the reference's dequantized weights, the bytes it keeps, the whole node graph on a GGUF DiT, and every
refusal.

Files are written here with the gguf package's `GGUFWriter`, in ComfyUI's key names (fused `img_mlp.gate_up`, q/k/v
split), as ComfyUI-GGUF's tools write them. Its numpy quantizers cover F32, F16, BF16, Q8_0, Q5_1, Q5_0, Q4_1 and
Q4_0; the K-quants (Q6_K, Q5_K, Q4_K, Q3_K, Q2_K) it can only dequantize, so their blocks are random bytes with
sane fp16 scales (centred and scaled to the weights' spread): valid blocks of the format, just not a fit of the
float weights, which no check here needs. Tensors a type cannot hold (rows not a multiple of its block: the 64-wide
`img_in` for the K-quants) stay in F16 and 1-D tensors in F32, as real converters keep them. Norm scales and other
1-D tensors are F32 throughout.
"""

import gc
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import graph_fixtures as gf
from dit_fixtures import make_case
from qi21.model.layers.gguf import FLOAT_TYPES, QUANT_TYPES, SUPPORTED_TYPES, GGUFLinear, dequantize
from qi21.model.loaders import gguf as gguf_loading
from qi21.model.loaders.dit import load_dit
from qi21.model.loaders.dit_keys import convert_state_dict, file_plan
from qi21.model.loaders.safetensors_io import CheckpointError
from qi21.model.loaders.vae import load_vae
from qi21.model.transformer.dit import DiTConfig, QwenImage21DiT

Q = gguf.GGMLQuantizationType
# width 8 x 32 = 256 and text width 256, so every block weight fits a 256-element K-quant block
CONFIG = DiTConfig(num_layers=2, num_heads=8, head_dim=32, context_in_dim=256, mlp_ratio=3, axes_dims_rope=(4, 14, 14))
NUMPY_QUANTIZED = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
K_QUANTS = ("Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K")
# where each type keeps its fp16 scales ("d", then "dmin" where it has one), and the dmin/d ratio that centres a
# random block on zero (mean of scale * quant over mean of min)
K_SCALES = {"Q6_K": ((208,), 0), "Q5_K": ((0, 2), 15.5), "Q4_K": ((0, 2), 7.5), "Q3_K": ((108,), 0),
            "Q2_K": ((80, 82), 1.5)}
SCALE_AT = {"Q8_0": (0,), "Q5_1": (0, 2), "Q5_0": (0,), "Q4_1": (0, 2), "Q4_0": (0,),
            **{name: at for name, (at, _) in K_SCALES.items()}}


# -- writing GGUF files ---------------------------------------------------------------------------------------------
def random_model(config: DiTConfig = CONFIG, seed: int = 0) -> QwenImage21DiT:
    torch.manual_seed(seed)
    model = QwenImage21DiT(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # norm scales around 1; the zero-centred text norm stores scale - 1
                param.copy_(0.2 * torch.randn_like(param) + (0.0 if "text_norm" in name else 1.0))
            else:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
    return model.eval()


def comfy_tensors(model: QwenImage21DiT) -> dict[str, np.ndarray]:
    """The model under ComfyUI's file keys (q/k/v split, gate_up fused), fp32 numpy."""
    state = model.state_dict()
    out = {}
    for name, keys in file_plan(model.config, fused_mlp=True).items():
        for key, part in zip(keys, state[name].float().chunk(len(keys))):
            out[key] = part.contiguous().numpy()
    return out


def random_k_blocks(qtype: str, rows: int, width: int, rng, spread: float) -> np.ndarray:
    """`rows` rows of random `qtype` blocks, `(rows, bytes per row)` uint8, values centred with std ~`spread`."""
    block, size = QUANT_TYPES[qtype]
    count = rows * width // block
    blocks = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    (scale_at, centre) = K_SCALES[qtype]

    def set_scales(d):
        blocks[:, scale_at[0] : scale_at[0] + 2] = d.astype(np.float16).view(np.uint8).reshape(count, 2)
        if len(scale_at) > 1:
            blocks[:, scale_at[1] : scale_at[1] + 2] = (d * centre).astype(np.float16).view(np.uint8).reshape(count, 2)

    d = rng.uniform(0.5, 1.0, count).astype(np.float32)
    set_scales(d)
    std = float(gguf.quants.dequantize(blocks, Q[qtype]).std())
    set_scales(d * (spread / std))
    return blocks.reshape(rows, -1)


def encode(array: np.ndarray, qtype: str, rng) -> tuple[np.ndarray, str]:
    """(data for GGUFWriter.add_tensor, type actually used): 1-D and rows a type cannot hold fall back."""
    if array.ndim == 1:
        return array.astype(np.float32), "F32"
    block = QUANT_TYPES[qtype][0] if qtype in QUANT_TYPES else 1
    if array.shape[-1] % block:
        return array.astype(np.float16), "F16"
    if qtype in K_QUANTS:
        return random_k_blocks(qtype, array.shape[0], array.shape[1], rng, float(array.std())), qtype
    return gguf.quants.quantize(array, Q[qtype]), qtype


def write_gguf(path: Path, tensors: dict[str, np.ndarray], types, prefix: str = "", arch: str = "qwen_image",
               flatten=(), seed: int = 0, extra=None) -> Path:
    """A GGUF file of `tensors`; `types(key)` gives each key's GGUF type name. Keys in `flatten` are stored as rows
    of 256 with `comfy.gguf.orig_shape.<key>` (ComfyUI-GGUF's layout for rows that do not fit a block)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, array in tensors.items():
        if key in flatten:
            writer.add_array(f"comfy.gguf.orig_shape.{prefix}{key}", list(array.shape))
            array = array.reshape(-1, 256)
        data, qtype = encode(array, types(key), rng)
        writer.add_tensor(prefix + key, data, raw_dtype=Q[qtype])
    for key, value in (extra or {}).items():
        writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """{key without prefix: (type, the gguf package's dequantization in the logical shape)}."""
    reader = gguf.GGUFReader(path)
    out = {}
    for tensor in reader.tensors:
        field = reader.get_field(f"comfy.gguf.orig_shape.{tensor.name}")
        shape = [int(field.parts[i][0]) for i in field.data] if field is not None else list(reversed(tensor.shape))
        values = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type).reshape(shape)
        out[tensor.name.removeprefix("model.diffusion_model.")] = (tensor.tensor_type.name, values)
    del reader
    return out


def model_from_reference(path: Path, config: DiTConfig = CONFIG) -> QwenImage21DiT:
    """A plain fp32 DiT holding the gguf package's dequantization of every tensor of `path`."""
    state = {key: torch.from_numpy(values.copy()) for key, (_, values) in reference_tensors(path).items()}
    model = QwenImage21DiT(config)
    model.load_state_dict(convert_state_dict(state))
    return model.eval()


def payload_bytes(path: Path) -> int:
    reader = gguf.GGUFReader(path)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    del reader
    return total


def single_type(qtype):
    return lambda key: qtype


def k_m_mix(key: str) -> str:
    """A "Q4_K_M"-like mix: to_v and the MLP's down projection one step up, everything else Q4_K."""
    return "Q6_K" if key.endswith(("attn.to_v.weight", "img_mlp.out.weight")) else "Q4_K"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    model = random_model()
    tensors = comfy_tensors(model)
    root = tmp_path_factory.mktemp("gguf")
    written = {qtype: write_gguf(root / f"qwen_image_2.1-{qtype}.gguf", tensors, single_type(qtype), seed=i)
               for i, qtype in enumerate(SUPPORTED_TYPES)}
    # mixed types inside the fused q/k/v weight, the ComfyUI prefix, a flattened img_in, Turbo by name
    written["mix"] = write_gguf(root / "qwen_image_2.1_turbo-Q4_K_M.gguf", tensors, k_m_mix,
                                prefix="model.diffusion_model.", flatten=("img_in.weight",), seed=99)
    return root, written


def velocity(model, mode="uncached"):
    _, prefixes, x = make_case(((4, 4),), (4, 6), (5, 7), context_dim=CONFIG.context_in_dim)
    with torch.no_grad():
        if mode == "uncached":
            return model(x, 0.6, prefixes)
        from qi21.model.prefix_cache.layout import PrefixKVCache

        cache = PrefixKVCache()
        model(x, 0.9, prefixes, cache=cache, mode="prefill")
        return model(x, 0.6, prefixes, cache=cache, mode="cached")


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32)


# -- 1. the kernels -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_block_kernels_equal_the_reference_bit_for_bit(qtype):
    """Random bytes in every position (all quant and scale-index bit patterns) with finite fp16 scales; for the
    types gguf can quantize, also real quantized data."""
    rng = np.random.default_rng(1)
    block, size = QUANT_TYPES[qtype]
    blocks = rng.integers(0, 256, size=(517, size), dtype=np.uint8)
    for at in SCALE_AT[qtype]:
        blocks[:, at : at + 2] = (rng.standard_normal(517) * 0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
    samples = [blocks]
    if qtype in NUMPY_QUANTIZED:
        samples.append(gguf.quants.quantize(rng.standard_normal((7, 4 * block)).astype(np.float32), Q[qtype]))
    for data in samples:
        reference = gguf.quants.dequantize(data, Q[qtype]).reshape(-1)
        ours = dequantize(qtype, torch.from_numpy(np.ascontiguousarray(data)))
        assert torch.equal(bits(ours), bits(torch.from_numpy(reference)))


@pytest.mark.parametrize("qtype", list(FLOAT_TYPES))
def test_float_types_equal_the_reference_bit_for_bit(qtype):
    values = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    data = gguf.quants.quantize(values, Q[qtype])
    reference = gguf.quants.dequantize(data, Q[qtype]).reshape(-1)
    ours = dequantize(qtype, torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)))
    assert torch.equal(bits(ours), bits(torch.from_numpy(np.ascontiguousarray(reference))))


def test_block_sizes_are_llama_cpp_s():
    for qtype, sizes in QUANT_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[Q[qtype]] == sizes


# -- 2. loaded models -----------------------------------------------------------------------------------------------
def gguf_layers(model):
    return {name: module for name, module in model.named_modules() if isinstance(module, GGUFLinear)}


@pytest.mark.parametrize("qtype", [*SUPPORTED_TYPES, "mix"])
def test_every_tensor_and_the_output_equal_the_reference(files, qtype):
    root, written = files
    path = written[qtype]
    model = load_dit(path, weight_dtype="fp32")
    assert model.source.layout == "gguf" and model.config == CONFIG
    assert model.source.variant == ("turbo" if qtype == "mix" else "base")
    reference = reference_tensors(path)
    plan = file_plan(CONFIG, fused_mlp=True)
    layers = gguf_layers(model)
    assert len(layers) == sum(1 for keys in plan.values() if reference[keys[0]][1].ndim == 2)
    rng = np.random.default_rng(3)
    for name, keys in plan.items():
        expected = torch.cat([torch.from_numpy(reference[key][1].copy()) for key in keys])
        module_name, _, attr = name.rpartition(".")
        if module_name in layers:
            layer = layers[module_name]
            assert {seg.qtype for seg in layer.segments} == {reference[key][0] for key in keys}
            assert torch.equal(bits(layer.weight_rows(0, layer.out_features, torch.float32)), bits(expected))
            for _ in range(3):  # any rows, across segment boundaries too
                start = int(rng.integers(0, layer.out_features))
                end = int(rng.integers(start + 1, layer.out_features + 1))
                assert torch.equal(bits(layer.weight_rows(start, end, torch.float32)), bits(expected[start:end]))
        else:  # 1-D: dequantized at load
            assert torch.equal(bits(model.get_parameter(name)), bits(expected))
    plain = model_from_reference(path)
    for mode in ("uncached", "cached"):
        ours, theirs = velocity(model, mode), velocity(plain, mode)
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "BF16", "mix"])
def test_resident_bytes_are_the_file_payload(files, qtype):
    """No silent upcast: each quantized layer keeps the file's bytes (1-D tensors are F32 in the file and fp32 in
    the model, so the totals are equal)."""
    root, written = files
    model = load_dit(written[qtype], weight_dtype="fp32")
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    assert resident == payload_bytes(written[qtype])
    layer = model.blocks[0].gate_up
    stored = {p.dtype for p in layer.parameters()}
    assert stored == ({FLOAT_TYPES[qtype]} if qtype in FLOAT_TYPES else {torch.uint8})
    assert layer.weight.is_meta and layer.weight.shape == (2 * CONFIG.mlp_hidden, CONFIG.width)


def test_bf16_compute_rounds_the_exact_dequantization(files):
    root, written = files
    fp32, bf16 = (load_dit(written["Q4_K"], weight_dtype=dtype) for dtype in ("fp32", "bf16"))
    assert bf16.compute_dtype == torch.bfloat16 and bf16.txt_in.text_norm.weight.dtype == torch.bfloat16
    exact = fp32.blocks[1].qkv.weight_rows(0, 3 * CONFIG.width, torch.float32)
    assert torch.equal(bf16.blocks[1].qkv.weight_rows(0, 3 * CONFIG.width, torch.bfloat16), exact.bfloat16())
    plain = model_from_reference(written["Q4_K"]).to(torch.bfloat16)  # the same weights, rounded to bf16
    plain.compute_dtype = torch.bfloat16
    torch.testing.assert_close(velocity(bf16), velocity(plain), rtol=0, atol=0)


def test_floating_casts_leave_the_quantized_bytes_alone(files):
    root, written = files
    model = load_dit(written["mix"], weight_dtype="fp32")
    before = velocity(model)
    model.to(torch.float32)
    assert {p.dtype for p in model.blocks[0].qkv.parameters()} == {torch.uint8}
    torch.testing.assert_close(velocity(model), before, rtol=0, atol=0)


# -- 3. file safety -------------------------------------------------------------------------------------------------
def _mapped(path: Path) -> list[tuple[int, int]]:
    spans = []
    target = str(path.resolve())
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[-1] == target:
            begin, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((begin, end))
    return spans


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc/self/maps (Linux)")
def test_the_model_does_not_live_on_the_file(files, tmp_path):
    root, written = files
    path = tmp_path / "copy.gguf"
    shutil.copy(written["Q8_0"], path)
    model = load_dit(path, weight_dtype="fp32")
    gc.collect()
    assert _mapped(path) == []  # the reader's memory map is gone once the model is built
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    size = path.stat().st_size
    with open(path, "r+b") as handle:  # rewrite the tensor data in place
        handle.seek(size // 2)
        handle.write(bytes(size - size // 2))
    assert all(torch.equal(p.detach().view(torch.uint8), before[n].view(torch.uint8))
               for n, p in model.named_parameters())


# -- 4. refusals ----------------------------------------------------------------------------------------------------
def expect_refusal(path, match, error=CheckpointError, **kwargs):
    before = gf.live_models()
    with pytest.raises(error, match=match) as info:
        load_dit(path, **kwargs)
    assert path.name in str(info.value)
    assert gf.live_models() == before  # nothing half-loaded stays behind
    return str(info.value)


def test_another_architecture_is_named(tmp_path):
    flux = {"double_blocks.0.img_attn.proj.weight": np.ones((64, 64), np.float32),
            "img_in.weight": np.ones((64, 64), np.float32)}
    expect_refusal(write_gguf(tmp_path / "flux1-dev-Q4_0.gguf", flux, single_type("Q4_0"), arch="flux"),
                   r"GGUF of Flux \(general.architecture = 'flux'\), not a Qwen-Image 2.1 DiT")
    llm = {"token_embd.weight": np.ones((64, 64), np.float32), "blk.0.attn_q.weight": np.ones((64, 64), np.float32)}
    expect_refusal(write_gguf(tmp_path / "Qwen3-8B-Q4_K_M.gguf", llm, single_type("Q8_0"), arch="qwen3",
                              extra={"tokenizer.ggml.model": "gpt2"}),
                   r"language model GGUF \(general.architecture = 'qwen3'")
    old = {"txt_norm.weight": np.ones(64, np.float32), "transformer_blocks.0.img_mod.1.weight":
           np.ones((64, 64), np.float32), "img_in.weight": np.ones((64, 64), np.float32)}
    expect_refusal(write_gguf(tmp_path / "qwen-image-edit-2509-Q4_0.gguf", old, single_type("Q4_0")),
                   r"general.architecture = 'qwen_image'\) is a Qwen-Image 1.x DiT")


def test_an_unsupported_type_is_named_with_the_supported_ones(tmp_path):
    tensors = comfy_tensors(random_model())
    types = lambda key: "Q8_0"  # noqa: E731
    path = tmp_path / "qwen_image_2.1-IQ4_NL.gguf"
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch="qwen_image")
    for key, array in tensors.items():
        if key == "transformer_blocks.1.attn.to_k.weight":
            blocks = rng.integers(0, 256, size=(array.size // 32, 18), dtype=np.uint8)
            writer.add_tensor(key, blocks.reshape(array.shape[0], -1), raw_dtype=Q.IQ4_NL)
        else:
            data, qtype = encode(array, types(key), rng)
            writer.add_tensor(key, data, raw_dtype=Q[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = expect_refusal(path, "transformer_blocks.1.attn.to_k.weight is IQ4_NL")
    assert ", ".join(SUPPORTED_TYPES) in message


@pytest.mark.parametrize("keep, match", [
    pytest.param(0.6, r"is truncated: its tensor table describes [\d,]+ bytes but the file has [\d,]+ \(6\d\.\d%\)",
                 id="cut in the tensor data"),
    pytest.param(200, "the GGUF header or tensor table cannot be read .* cut short or damaged", id="cut in the header"),
])
def test_a_truncated_file_is_refused(files, tmp_path, keep, match):
    root, written = files
    data = written["Q4_0"].read_bytes()
    path = tmp_path / "qwen_image_2.1-Q4_0.gguf"
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    expect_refusal(path, match)


def test_without_the_gguf_package_the_message_says_how_to_install_it(files, monkeypatch):
    root, written = files
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now fails as if it were not installed
    expect_refusal(written["Q8_0"], r"needs the gguf package.*pip install gguf", error=ImportError)


def test_fp8_is_refused_for_a_gguf_file(files):
    root, written = files
    with pytest.raises(ValueError, match="not supported for the GGUF DiT, whose weights stay in the file's"):
        load_dit(written["Q8_0"], weight_dtype="fp8_e4m3fn")


def test_other_loaders_name_a_gguf_file(files, tmp_path):
    root, written = files
    path = tmp_path / "qwen_image_2.1_vae-Q8_0.gguf"
    shutil.copy(written["Q8_0"], path)
    with pytest.raises(CheckpointError, match="is a GGUF file, not a safetensors file. GGUF is read for the Qwen"):
        load_vae(path)


def test_a_load_that_fails_halfway_leaves_nothing(files, monkeypatch):
    root, written = files
    real, calls = gguf_loading._owned, {"n": 0}

    def failing(target, source):
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt
        return real(target, source)

    monkeypatch.setattr(gguf_loading, "_owned", failing)
    before = gf.live_models()
    with pytest.raises(KeyboardInterrupt):
        load_dit(written["Q5_K"])
    assert gf.live_models() == before


def test_gguf_is_imported_only_to_read_a_gguf_file():
    import subprocess

    pack_import = Path(__file__).resolve().parents[1] / "demo" / "pack_import.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('h', {str(pack_import)!r})\n"
        "h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h); h.import_pack()\n"
        "import qi21.model.loaders.dit, qi21.model.loaders.gguf, qi21.model.layers.gguf, qi21.nodes.loaders\n"
        "assert 'gguf' not in sys.modules, 'gguf imported at start-up'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


# -- 5. the node graph ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_models_root(tiny_models, tmp_path_factory):
    """The tiny set's text encoder and VAE, and its Turbo DiT as a Q8_0 GGUF (the tiny DiT's 16-wide text input
    fits no block, so txt_in.in_layer stays BF16 like the source)."""
    from safetensors.torch import load_file

    from qi21.nodes import bridge

    root = tmp_path_factory.mktemp("gguf_models")
    for folder in ("text_encoders", "vae"):
        (root / folder).symlink_to(tiny_models["root"] / folder, target_is_directory=True)
    (root / "diffusion_models").mkdir()
    state = load_file(tiny_models["turbo_dit"])
    tensors = {key.removeprefix("model.diffusion_model."): value.float().numpy() for key, value in state.items()}

    def types(key):
        return "BF16" if tensors[key].ndim == 2 and tensors[key].shape[1] % 32 else "Q8_0"

    write_gguf(root / "diffusion_models" / "qwen_image_2.1_turbo-Q8_0.gguf", tensors, types)
    bridge.set_models_root(root)
    yield root
    bridge.set_models_root(None)


def test_a_gguf_dit_is_listed_and_runs_a_whole_turbo_graph(gguf_models_root):
    from qi21.nodes.conditioning import QI21Reference, QI21TextEncode
    from qi21.nodes.decode import QI21VAEDecode
    from qi21.nodes.loaders import QI21ModelLoader, QI21TextEncoderLoader, QI21VAELoader
    from qi21.nodes.samplers import QI21TurboSampler

    name = "qwen_image_2.1_turbo-Q8_0.gguf"
    assert name in QI21ModelLoader.define_schema().inputs[0].options["options"]  # listed, and accepted
    assert QI21ModelLoader.validate_inputs(name, weight_dtype="default") is True
    model = QI21ModelLoader.execute(name, "default")[0]
    assert (model.source.layout, model.source.variant) == ("gguf", "turbo")
    assert {p.dtype for p in model.blocks[0].qkv.parameters()} == {torch.uint8}
    encoder = QI21TextEncoderLoader.execute(gf.SINGLE["text_encoder"], "fp32")[0]
    vae = QI21VAELoader.execute(gf.SINGLE["vae"], "fp32")[0]
    generator = torch.Generator().manual_seed(0)
    image = torch.rand(1, 256, 256, 4, generator=generator)
    refs = QI21Reference.execute(vae, image, 0)[0]
    positive = QI21TextEncode.execute(encoder, "turn <image1> into a watercolour", refs)[0]
    out = QI21TurboSampler.execute(model, positive, 7, 256, 256, 1)
    latent, report = out[0], out.ui["qi21_report"][0]
    assert latent["samples"].shape == (1, 64, 16, 16) and torch.isfinite(latent["samples"]).all()
    assert report["steps"] == 8 and report["cache"] == "miss"
    rgb, mask, rgba = QI21VAEDecode.execute(vae, latent).args
    assert rgb.shape == (1, 256, 256, 3) and mask.shape == (1, 256, 256) and torch.isfinite(rgba).all()
