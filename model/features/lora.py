"""The LoRA node: LoRA branches beside the blocks' weights of a model copy (model/loaders/lora.py reads a file and
attaches it; `apply_lora` here records it on the copy's record, the one place that says which LoRAs a copy has); a
run reports each LoRA with its strength and the notes of its loading."""

from ..loaders.lora import AppliedLora, attach_lora
from .plugin import Feature, RunPart, Supported
from .record import record_on


def apply_lora(model, path, strength: float = 1.0, name: str | None = None):
    """`model` with the LoRA in `path` at `strength`, as a new model object sharing every weight with `model` (which
    is never changed), its record's `loras` extended; chain calls to stack LoRAs."""
    new, applied = attach_lora(model, path, strength, name)
    record = record_on(model)
    new.options = record.replace(loras=record.loras + (applied,))
    return new


def lora_set(model) -> tuple[tuple[str, float], ...]:
    """(name, strength) of each LoRA on `model`'s record, in order; () for a plain model."""
    return tuple((lora.name, lora.strength) for lora in record_on(model).loras)


def _check(record) -> None:
    wrong = [type(lora).__name__ for lora in record.loras if not isinstance(lora, AppliedLora)]
    if not isinstance(record.loras, tuple) or wrong:
        raise ValueError(f"loras must be a tuple of AppliedLora (model/loaders/lora.py); got {wrong or record.loras}.")


class LoraPart(RunPart):
    def __init__(self, applied):
        self.applied = applied

    def finish(self, report: dict, notes: list, run) -> None:
        report["loras"] = [{"name": lora.name, "strength": lora.strength} for lora in self.applied]
        notes.extend(note for lora in self.applied for note in lora.notes)


FEATURE = Feature(
    name="lora", label="the LoRA node",
    fields={"loras": ()},  # an AppliedLora (name, strength, notes) per LoRA node, in order
    is_on=lambda record: bool(record.loras),
    check=_check,
    verdicts={
        "cache": Supported("the cache stores what the LoRA'd blocks computed"),
        "step_cache": Supported("the LoRA is in the blocks; the step cache reads their outputs"),
        "control": Supported("LoRAs change the base blocks; the control stream reads their rows"),
        "compile": Supported("a LoRA branch is part of the compiled block"),
        "devices": Supported("the LoRA joins the workers' recipe; each rank applies it as this process does"),
    },
    start_run=lambda model, record, run: LoraPart(record.loras),
    # another LoRA or strength never reuses a kept prefix (the notes say nothing about the rows)
    kept_identity=lambda model, record: tuple((lora.name, lora.strength) for lora in record.loras),
    route_inputs={"QI21LoraLoader": ("model", "lora_name", "strength")},
)
