"""The step cache's presets: complete `StepCacheOptions`, chosen from benchmarks/step_cache_peers.py's curve on the
trained toy (docs/step-cache.md) and stored in step_cache_presets.json beside this file. The Step Cache node offers
them by name; each replaces every other input of the node. A calibrated schedule's full steps are shares of the run
(step i of n at i / n), so a preset calibrated at 40 steps places its full steps at other step counts too."""

import dataclasses
import functools
import json
from pathlib import Path

from .step_cache import StepCacheOptions

PRESETS_FILE = Path(__file__).with_name("step_cache_presets.json")
FIELDS = tuple(field.name for field in dataclasses.fields(StepCacheOptions))
NOTES = ("description", "measured")  # what a person reads; not options


def load_presets(path: Path = PRESETS_FILE) -> dict[str, StepCacheOptions]:
    """name -> options, in the file's order. A bad file is refused naming the preset and the field."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    presets = data.get("presets") if isinstance(data, dict) else None
    if not isinstance(presets, dict) or not presets:
        raise ValueError(f"{path}: 'presets' must be an object of preset name -> options; got "
                         f"{type(presets).__name__}.")
    out = {}
    for name, entry in presets.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: preset {name!r} must be an object of options; got {type(entry).__name__}.")
        unknown = sorted(set(entry) - set(FIELDS) - set(NOTES))
        if unknown:
            raise ValueError(f"{path}: preset {name!r} has unknown fields {unknown}; expected some of {list(FIELDS)}.")
        fields = {key: value for key, value in entry.items() if key in FIELDS}
        if isinstance(fields.get("schedule"), list):
            fields["schedule"] = tuple(fields["schedule"])
        try:
            out[name] = StepCacheOptions(**fields)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: preset {name!r}: {error}") from None
    return out


@functools.lru_cache(maxsize=1)
def shipped_presets() -> dict[str, StepCacheOptions]:
    """The presets the pack ships (read once per process)."""
    return load_presets(PRESETS_FILE)
