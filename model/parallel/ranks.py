"""A rank list checked whole before any worker process starts: the loader's `devices` text, its count, each device,
and the rule that Ulysses' ranks divide the model's attention heads.

    parse_devices(text)                 "cuda:0, cuda:1" -> ("cuda:0", "cuda:1"), or a ValueError naming the input
    check_ranks(names, mode, gpus, ...)  the count (at most MAX_RANKS), each GPU present, the mode's count, the heads
    file_heads(path)                    a DiT's attention heads from its file headers alone (no weight is read)

Every check is bounded by the input and runs in the host, in milliseconds, before a process is spawned: a list of
2,500 CPU ranks once started a worker per rank and met the heads rule only inside each of them. Messages quote at
most a short prefix of what was typed.
"""

from pathlib import Path

from ..loaders.checkpoint import CheckpointError, find_weights, read_weight_headers
from ..loaders.dit_keys import strip_prefix
from ..loaders.safetensors_io import shown
from .ulysses import check_world

#: One worker process per rank, each holding the whole model: 16 covers the largest single machines (8-16 GPUs);
#: beyond, a head share of 2 of the 32 heads has nothing left to split.
MAX_RANKS = 16
MAX_DEVICES_TEXT = 4096  # characters of the `devices` text (16 ranks of "cuda:15, " take 144)
QUOTE = 40  # characters of a typed value a message quotes


def quoted(text) -> str:
    return shown(text, QUOTE)


def parse_devices(text: str, what: str = "devices") -> tuple[str, ...]:
    """`"cuda:0, cuda:1"` -> `("cuda:0", "cuda:1")`; a clear error naming `what` for anything else. "" is ()."""
    text = str(text)
    if len(text) > MAX_DEVICES_TEXT:
        raise ValueError(f"{what}: {quoted(text)} is longer than {MAX_DEVICES_TEXT} characters; name at most "
                         f"{MAX_RANKS} devices, such as 'cuda:0,cuda:1'.")
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if len(names) > MAX_RANKS:
        raise ValueError(f"{what} names {len(names)} devices; at most {MAX_RANKS} are supported (one worker process "
                         "per device, each holding the whole model).")
    for name in names:
        kind, _, index = name.partition(":")
        if kind not in ("cpu", "cuda") or (index and not (index.isascii() and index.isdigit())) or (
                kind == "cpu" and index) or len(index) > 4:
            raise ValueError(f"{what}: {quoted(name)} is not a device; write a comma list such as 'cuda:0,cuda:1' (or "
                             "'cpu,cpu' for CPU ranks).")
    kinds = {name.partition(":")[0] for name in names}
    if len(kinds) > 1:
        raise ValueError(f"{what}: {', '.join(names)} mixes CPU and GPU ranks; use only cuda devices or only cpu.")
    cudas = [int(n.partition(":")[2] or 0) for n in names if n.startswith("cuda")]
    if len(set(cudas)) != len(cudas):
        raise ValueError(f"{what}: {', '.join(names)} names a GPU twice; each rank needs a GPU of its own.")
    return names


def check_ranks(names: tuple[str, ...], mode: str, gpus: int, heads: int | None = None,
                what: str = "devices") -> None:
    """Refuse, before anything starts, a rank list that cannot run `mode` ("off", "ulysses", "cfg") here: a GPU this
    machine does not have (`gpus`: how many torch sees), a count the mode cannot use, or (ulysses) a count that does
    not divide the model's `heads` (None: unknown here, checked by the workers)."""
    missing = [n for n in names if n.startswith("cuda") and int(n.partition(":")[2] or 0) >= gpus]
    if missing:
        seen = f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus else "no GPU"
        raise ValueError(f"{what}: this machine has no GPU {missing[0]} (torch sees {seen}); name the GPUs it has, or "
                         "leave devices empty to run in ComfyUI's process.")
    if mode == "off" and len(names) > 1:
        raise ValueError(f"{what} names {len(names)} devices with parallel off; name one (the DiT on a device of its "
                         "own) or choose ulysses or cfg to split it over them.")
    if mode == "cfg" and len(names) != 2:
        raise ValueError(f"parallel = cfg runs CFG's two prompts on two devices; {what} names {len(names)}. Use "
                         "ulysses for more.")
    if mode == "ulysses" and len(names) < 2:
        raise ValueError(f"parallel = ulysses needs at least two devices in {what} (e.g. cuda:0,cuda:1); got "
                         f"{len(names)}.")
    if mode == "ulysses" and heads is not None:
        check_world(heads, len(names))


def file_heads(path) -> int | None:
    """The attention heads of the DiT file or diffusers folder at `path`, from its headers (width of `img_in` over
    the head size of `norm_q`); None when they cannot tell (a GGUF file, another layout): the loader's own checks
    then speak, and the workers check the heads as before."""
    try:
        if Path(path).is_file() and Path(path).suffix.lower() == ".gguf":
            return None
        tensors, _ = read_weight_headers(find_weights(path, "transformer", "a Qwen-Image 2.1 DiT"))
    except (CheckpointError, OSError, ValueError):
        return None
    shapes = {strip_prefix(key): info.shape for key, info in tensors.items()}
    width, head = shapes.get("img_in.weight"), shapes.get("transformer_blocks.0.attn.norm_q.weight")
    if not width or not head or len(width) != 2 or len(head) != 1 or head[0] <= 0 or width[0] % head[0]:
        return None
    return width[0] // head[0]
