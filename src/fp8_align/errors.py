"""The error every configuration check of fp8_align raises (config fields, NeMo RL keys, YAML files)."""


class FP8ConfigError(ValueError):
    """A configuration that cannot run, with a message that says what to change."""
