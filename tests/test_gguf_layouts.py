"""The three GGUF DiT layouts in the wild (`../shared/design/ECOSYSTEM.md` section 4), written with the `gguf`
package's `GGUFWriter` and loaded: each equals the same weights in the plain layout (ComfyUI-GGUF's: architecture
`qwen_image`, bare ComfyUI names, fused `img_mlp.gate_up`), bit for bit, and in F32 the plain safetensors file.

- leejet/Qwen-Image-2.1-GGUF (stable-diffusion.cpp): no `general.architecture` at all, bare ComfyUI names, fused
  `img_mlp.gate_up`;
- abenzerps/Qwen-Image-2.1-GGUF: `general.architecture = qwen_image21`, the MLP split into `img_mlp.gate_layer` and
  `img_mlp.proj` (diffusers' names);
- unsloth (second-hand): every key under `model.diffusion_model.`.
"""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from qi21.model.loaders.dit import load_dit
from test_gguf import comfy_tensors, encode, random_model, velocity

Q = gguf.GGMLQuantizationType
#: publisher -> (general.architecture or None, key prefix, fused MLP)
LAYOUTS = {
    "plain (ComfyUI-GGUF)": ("qwen_image", "", True),
    "leejet": (None, "", True),
    "abenzerps": ("qwen_image21", "", False),
    "unsloth": ("qwen_image", "model.diffusion_model.", True),
}


def split_mlp(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each block's fused `img_mlp.gate_up` as diffusers' `gate_layer` (the SiLU half, rows first) and `proj`."""
    out = {}
    for key, value in tensors.items():
        if key.endswith("img_mlp.gate_up.weight"):
            stem = key[: -len("gate_up.weight")]
            gate, up = np.split(value, 2)
            out[stem + "gate_layer.weight"], out[stem + "proj.weight"] = gate, up
        else:
            out[key] = value
    return out


def write_layout(path: Path, tensors: dict[str, np.ndarray], layout: str, qtype: str) -> Path:
    arch, prefix, fused = LAYOUTS[layout]
    writer = gguf.GGUFWriter(path, arch=arch or "none")
    if arch is None:  # the writer always adds one; stable-diffusion.cpp's files carry none
        del writer.kv_data[0]["general.architecture"]
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    rng = np.random.default_rng(0)
    for key, array in (tensors if fused else split_mlp(tensors)).items():
        data, used = encode(array, qtype, rng)
        writer.add_tensor(prefix + key, data, raw_dtype=Q[used])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def architecture(path: Path) -> str | None:
    field = gguf.GGUFReader(path).get_field("general.architecture")
    return None if field is None else bytes(field.parts[field.data[0]]).decode()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_layouts")
    model = random_model()
    tensors = comfy_tensors(model)
    files = {(layout, qtype): write_layout(root / f"{layout.split()[0]}-qwen_image_2.1-{qtype}.gguf", tensors,
                                           layout, qtype)
             for layout in LAYOUTS for qtype in ("Q8_0", "F32")}
    plain = root / "qwen_image_2.1_bf16.safetensors"  # the plain file, fp32 values
    save_file({k: torch.from_numpy(v).contiguous() for k, v in tensors.items()}, str(plain))
    return files, plain


def test_the_files_are_written_in_each_layout(written):
    files, _ = written
    for (layout, _), path in files.items():
        arch, prefix, fused = LAYOUTS[layout]
        assert architecture(path) == arch, layout
        names = [t.name for t in gguf.GGUFReader(path).tensors]
        assert all(name.startswith(prefix) for name in names) and (prefix == "" or prefix in names[0])
        assert any(n.endswith("img_mlp.gate_up.weight") for n in names) == fused
        assert any(n.endswith("img_mlp.gate_layer.weight") for n in names) != fused


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "plain (ComfyUI-GGUF)"])
def test_each_layout_loads_equal_to_the_plain_layout_and_file(written, layout):
    files, plain_file = written
    plain = load_dit(files[("plain (ComfyUI-GGUF)", "Q8_0")], weight_dtype="fp32")
    model = load_dit(files[(layout, "Q8_0")], weight_dtype="fp32")
    assert model.source.layout == "gguf" and model.config == plain.config
    got, want = model.state_dict(), plain.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(velocity(model), velocity(plain))
    as_f32 = load_dit(files[(layout, "F32")], weight_dtype="fp32")
    reference = load_dit(plain_file, weight_dtype="fp32")
    for name, param in reference.named_parameters():  # every weight equal to the plain safetensors file's
        module, _, attr = name.rpartition(".")
        linear = as_f32.get_submodule(module) if attr == "weight" else None
        values = linear.weight_rows(0, param.shape[0], torch.float32) if hasattr(linear, "weight_rows") else \
            dict(as_f32.named_parameters())[name]
        assert torch.equal(values, param.float()), (layout, name)
    assert torch.equal(velocity(as_f32), velocity(reference))
