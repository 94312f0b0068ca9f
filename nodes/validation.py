"""ComfyUI's own widget checks (min, max, combo options), put back for the nodes that have `validate_inputs`.

ComfyUI checks every widget value against its schema before a prompt runs, except on a node whose
`validate_inputs` takes `**kwargs`: it then leaves every input to that function (execution.py, `validate_inputs`:
`if x not in validate_function_inputs and not validate_has_kwargs:` guards the min/max/combo checks). Our loaders
and samplers take `**kwargs`, so they call `widget_problem` first; values sent through the API (or by a script
calling `execute`) then meet the same limits as values typed into the UI.

An input linked from another node (a primitive, a switch) reaches `validate_inputs` as None: its value only
exists once the graph runs. Every validator therefore passes None through, and every node checks again in
`execute` (with `require`), where all values are known; nothing a validator refuses gets through a link.
"""

from ..model.loaders.safetensors_io import shown

QUOTE = 60  # characters of a value that a message quotes (ComfyUI repeats a node's message once per input)


def quoted(value, limit: int = QUOTE) -> str:
    """`value` as a message quotes it: its repr, or for a long one a prefix of it and its length, so that an API
    client's 10,000-character "device" is not echoed back whole."""
    if isinstance(value, str):
        return shown(value, limit)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 3 * limit:
        sign = "a negative" if value < 0 else "an"  # repr of a huge int is slow, and refused past 4,300 digits
        return f"{sign} integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({type(value).__name__})"


def is_number(value) -> bool:
    """An int or a float (not a bool): what a range check may compare (a linked input may carry anything)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def widget_option(spec, key: str):
    """A widget option from ComfyUI's V3 input (attributes; a Combo's `options` is its list) or from our stand-in
    (everything beyond id/default/optional sits in its `options` dict)."""
    options = getattr(spec, "options", None)
    if isinstance(options, dict):
        return options.get(key)
    return options if key == "options" else getattr(spec, key, None)


def unknown_inputs_problem(node, names) -> str | None:
    """A message naming the node and every name in `names` that is not one of its inputs, or None.

    ComfyUI drops a constant (widget) value for an input a node does not have before the node sees it, for every
    node, but follows a *link* into such an input and passes its value on: core's own nodes then fail with a bare
    `TypeError: execute() got an unexpected keyword argument`. Such a link comes from a workflow saved with another
    version of the pack (a `sampler` wired in by a newer one) or an API client's typo; dropping it quietly would
    run something else than the graph shows, so it is refused by name instead."""
    schema = node.define_schema()
    known = [spec.id for spec in schema.inputs]
    unknown = [name for name in names if name not in known]
    if not unknown:
        return None
    listed = ", ".join(repr(str(name)[:60]) for name in unknown[:5])
    return (f"{schema.display_name} ({schema.node_id}) has no input {listed}; its inputs are {', '.join(known)}. The "
            "workflow was saved with another version of this pack, or the prompt misspells an input: remove that "
            "link, or update the pack to the version the workflow was made with.")


def refuse_unknown_inputs(node, unknown: dict) -> None:
    """What `execute(..., **unknown)` calls first: a ValueError naming the node and the inputs it does not have."""
    problem = unknown_inputs_problem(node, unknown) if unknown else None
    if problem is not None:
        raise ValueError(problem)


def widget_problem(node, **values) -> str | bool:
    """True when every given value fits its input's schema; else a message naming the first input that does not
    (or the inputs the node does not have: ComfyUI hands a linked one to `validate_inputs` as None).

    `None` values are skipped: ComfyUI passes None for every linked input at validation time (the value comes
    later), and `execute` checks again with the real values.
    """
    problem = unknown_inputs_problem(node, values)
    if problem is not None:
        return problem
    for spec in node.define_schema().inputs:
        value = values.get(spec.id)
        if value is None:
            continue
        choices = widget_option(spec, "options")
        if isinstance(choices, (list, tuple)) and value not in choices:
            shown = ", ".join(map(str, choices)) if len(choices) <= 20 else f"the {len(choices)} listed files"
            return f"{spec.id} = {quoted(value)}: expected one of {shown}."
        low, high = widget_option(spec, "min"), widget_option(spec, "max")
        if (low is not None or high is not None) and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            return f"{spec.id} = {quoted(value)}: expected a number from {low} to {high}."  # a link may carry anything
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (
                (low is not None and not value >= low) or (high is not None and not value <= high)):
            return f"{spec.id} = {quoted(value)}: expected a value from {low} to {high}."
    return True


def require(verdict: str | bool) -> None:
    """Raise a validator's message (anything but True) as a ValueError: the check `execute` repeats for the
    values that `validate_inputs` could not see."""
    if verdict is not True:
        raise ValueError(verdict)
