"""Names of the pack's torch operators (`torch.library.custom_op`): one namespace per loaded copy of the pack.

torch keeps operators in one process-wide registry and refuses a second definition of a name. ComfyUI imports the pack
by its folder name, and a second copy (another folder, or the tests' `qi21` beside a server's copy) defines the same
operators again: each copy gets a namespace of its own, derived from the name it was imported under.
"""

import re

_TOP = __name__.split(".")[0]
NAMESPACE = _TOP if _TOP == "qi21" else "qi21_" + re.sub(r"\W", "_", _TOP)


def op_name(name: str) -> str:
    """`name` as this copy's operator, `namespace::name`."""
    return f"{NAMESPACE}::{name}"
