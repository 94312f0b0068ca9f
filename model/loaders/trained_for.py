"""What a DiT file says it was trained for, and the one line a run gets when it asks for something else.

A file may declare, in its safetensors header metadata under `TRAINED_FOR_KEY`, the sizes and CFG scales its model
draws at, as a JSON object:

    {"model": "the toy model", "sizes": [[256, 256]], "cfg": [1],
     "expect": {"size": "noise", "cfg": "colours off the prompt"}}

`model` names it in the note, `sizes` lists (width, height) pairs, `cfg` the true-CFG scales (1: no guidance),
and the optional `expect` says what a picture shows at another size or scale. The toy trained here declares it
(demo/toy_model.py writes it into every DiT file of `write_toy_checkpoints`): it draws at 256x256 and cfg 1 only,
and a 1024x1024 graph on it ran for minutes into a near-black picture without a word. The released weights declare
nothing and get no note; the marker is read, never guessed from shapes (a toy-sized DiT may be anything).
"""

import json
import math
from dataclasses import dataclass

from .safetensors_io import CheckpointError, shown

TRAINED_FOR_KEY = "qi21.trained_for"
_EXAMPLE = '{"model": "the toy model", "sizes": [[256, 256]], "cfg": [1]}'
_MAX_TEXT = 200  # a name or an expectation is a few words; anything longer is not a marker of ours
DEFAULT_EXPECT = "weak pictures"  # what the note says where the marker has no `expect`


@dataclass(frozen=True)
class TrainedFor:
    """The sizes and CFG scales a model was trained for, and what to expect elsewhere."""

    model: str
    sizes: tuple[tuple[int, int], ...]
    cfg: tuple[float, ...]
    expect_size: str = DEFAULT_EXPECT
    expect_cfg: str = DEFAULT_EXPECT

    def to_json(self) -> str:
        """The metadata value a writer puts under `TRAINED_FOR_KEY` (read back by `read_trained_for`)."""
        return json.dumps({"model": self.model, "sizes": [list(size) for size in self.sizes], "cfg": list(self.cfg),
                           "expect": {"size": self.expect_size, "cfg": self.expect_cfg}})


def _text(value, what: str, where: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > _MAX_TEXT:
        raise CheckpointError(f"{where}: metadata {TRAINED_FOR_KEY} has {what} = {shown(value)}; expected a short "
                              f"text (at most {_MAX_TEXT} characters).")
    return value


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_trained_for(metadata: dict, where: str) -> TrainedFor | None:
    """The marker in a file's header metadata, or None without one. A marker that is not what `TRAINED_FOR_KEY`
    describes is a CheckpointError naming the file and the field: the file was made by a tool that meant something
    else by it, or it is damaged."""
    raw = metadata.get(TRAINED_FOR_KEY)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except (TypeError, ValueError, RecursionError):
        data = None
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: metadata {TRAINED_FOR_KEY} = {shown(raw)} is not a JSON object; expected "
                              f"one like {_EXAMPLE}.")
    sizes, scales = data.get("sizes"), data.get("cfg")
    if not (isinstance(sizes, list) and 0 < len(sizes) <= 64 and all(
            isinstance(size, list) and len(size) == 2 and all(type(side) is int and 0 < side <= 65536 for side in size)
            for size in sizes)):
        raise CheckpointError(f"{where}: metadata {TRAINED_FOR_KEY} has sizes = {shown(sizes)}; expected a list of "
                              "[width, height] pairs of positive whole numbers, e.g. [[256, 256]].")
    if not (isinstance(scales, list) and 0 < len(scales) <= 64 and all(_number(s) and s >= 1 for s in scales)):
        raise CheckpointError(f"{where}: metadata {TRAINED_FOR_KEY} has cfg = {shown(scales)}; expected a list of "
                              "CFG scales >= 1, e.g. [1].")
    expect = data.get("expect", {})
    if not isinstance(expect, dict):
        raise CheckpointError(f"{where}: metadata {TRAINED_FOR_KEY} has expect = {shown(expect)}; expected an "
                              'object like {"size": "noise", "cfg": "colours off the prompt"}.')
    return TrainedFor(_text(data.get("model"), "model", where), tuple((w, h) for w, h in sizes),
                      tuple(float(s) for s in scales),
                      *(_text(expect[key], f"expect.{key}", where) if key in expect else DEFAULT_EXPECT
                        for key in ("size", "cfg")))


def _sizes(trained: TrainedFor) -> str:
    return " or ".join(f"{w}x{h}" for w, h in trained.sizes)


def _scales(trained: TrainedFor) -> str:
    return " or ".join(f"{s:g}" for s in trained.cfg)


def trained_for_notes(model, width: int, height: int, cfg: float) -> list[str]:
    """The sampler's note when `model` (its `source.trained_for`, from the loader) was trained for other sizes or
    CFG scales than this run's (`cfg`: the scale in effect, 1 without a negative prompt); [] otherwise, and for a
    model that declares nothing."""
    trained = getattr(getattr(model, "source", None), "trained_for", None)
    if trained is None:
        return []
    size_off = (width, height) not in trained.sizes
    cfg_off = not any(math.isclose(cfg, scale, abs_tol=1e-6) for scale in trained.cfg)
    if not (size_off or cfg_off):
        return []
    asked, expect, use = [], [], []
    if size_off:
        asked.append(f"{width}x{height}")
        expect.append(trained.expect_size)
        use.append(_sizes(trained))
    if cfg_off:
        asked.append(f"cfg {cfg:g}")
        expect.append(trained.expect_cfg)
        use.append(f"cfg {_scales(trained)}")
    return [f"this is {trained.model} trained at {_sizes(trained)}, cfg {_scales(trained)}: at {', '.join(asked)} "
            f"expect {' and '.join(dict.fromkeys(expect))}; use {', '.join(use)}"]
