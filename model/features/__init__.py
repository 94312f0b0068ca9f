"""One module per feature of a model copy: what rides on it, declared in one place (docs/options.md).

A feature module holds one `Feature` (plugin.py): its fields of the options record with their defaults and
validation, when it is on, its verdicts against the features before it in `registry.ORDER` (the table of pairs),
and what it adds to a run: block hooks per model call, report keys, the kept-cache identity. The record
(model/options.py), the sampling loop, the kept-cache store and the report iterate over the registry and name no
feature; a new feature is a new module here and one line in registry.py (or `registry.register` from outside).
"""
