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


def widget_option(spec, key: str):
    """A widget option from ComfyUI's V3 input (attributes; a Combo's `options` is its list) or from our stand-in
    (everything beyond id/default/optional sits in its `options` dict)."""
    options = getattr(spec, "options", None)
    if isinstance(options, dict):
        return options.get(key)
    return options if key == "options" else getattr(spec, key, None)


def widget_problem(node, **values) -> str | bool:
    """True when every given value fits its input's schema; else a message naming the first input that does not.

    `None` values are skipped: ComfyUI passes None for every linked input at validation time (the value comes
    later), and `execute` checks again with the real values.
    """
    for spec in node.define_schema().inputs:
        value = values.get(spec.id)
        if value is None:
            continue
        choices = widget_option(spec, "options")
        if isinstance(choices, (list, tuple)) and value not in choices:
            shown = ", ".join(map(str, choices)) if len(choices) <= 20 else f"the {len(choices)} listed files"
            return f"{spec.id} = {value!r}: expected one of {shown}."
        low, high = widget_option(spec, "min"), widget_option(spec, "max")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (
                (low is not None and not value >= low) or (high is not None and not value <= high)):
            return f"{spec.id} = {value}: expected a value from {low} to {high}."
    return True


def require(verdict: str | bool) -> None:
    """Raise a validator's message (anything but True) as a ValueError: the check `execute` repeats for the
    values that `validate_inputs` could not see."""
    if verdict is not True:
        raise ValueError(verdict)
