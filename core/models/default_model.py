"""The model served when none is named: an alias the loader resolves (`sluice.core.models.loader.ALIASES`).

A module of its own so that the engine's flags (`sluice.core.args`) name it without importing the model classes,
and with them torch: `sluice --help` must not wait for torch.
"""

DEFAULT_MODEL = "smollm2-135m-instruct"
