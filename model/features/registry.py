"""The pack's features in their order (each module declares its verdicts against the ones before it). A new feature
is a module beside these and one line here; `record.register` adds one from outside (a test, another pack)."""

from . import cache, compile, control, devices, lora, plan, step_cache, weights
from .record import register

for _module in (cache, step_cache, control, compile, devices, lora, weights, plan):
    register(_module.FEATURE)
