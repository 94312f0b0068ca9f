"""Sampling. Importing the package loads the step methods, which register themselves with the step cache
(step_cache.py `StepCache.methods`): step_methods.py imports step_cache.py, never the other way."""

from . import step_methods  # noqa: F401  (registers `StepMethods`)
