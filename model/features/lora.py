"""The LoRA node: LoRA branches beside the blocks' weights of a model copy (model/loaders/lora.py applies them and
records each as an `AppliedLora`); a run reports each LoRA with its strength and the notes of its loading."""

from .plugin import Feature, RunPart, Supported


class LoraPart(RunPart):
    def __init__(self, applied):
        self.applied = applied

    def finish(self, report: dict, notes: list, run) -> None:
        report["loras"] = [{"name": lora.name, "strength": lora.strength} for lora in self.applied]
        notes.extend(note for lora in self.applied for note in lora.notes)


FEATURE = Feature(
    name="lora", label="the LoRA node",
    fields={"loras": ()},  # (name, strength) per LoRA node, in order
    is_on=lambda record: bool(record.loras),
    verdicts={
        "cache": Supported("the cache stores what the LoRA'd blocks computed"),
        "step_cache": Supported("the LoRA is in the blocks; the step cache reads their outputs"),
        "control": Supported("LoRAs change the base blocks; the control stream reads their rows"),
        "compile": Supported("a LoRA branch is part of the compiled block"),
        "devices": Supported("the LoRA joins the workers' recipe; each rank applies it as this process does"),
    },
    start_run=lambda model, record, run: LoraPart(model.loras) if getattr(model, "loras", ()) else None,
    kept_identity=lambda model, record: record.loras,  # another LoRA or strength never reuses a kept prefix
    route_inputs={"QI21LoraLoader": ("model", "lora_name", "strength")},
)
