"""Typed config schema, preset loading and start-up validation."""

from nemo_dapo.config.load import DEFAULT_PRESET, from_yaml, list_presets, load_config, to_yaml
from nemo_dapo.config.schema import Config
from nemo_dapo.config.validate import ConfigError, validate

__all__ = [
    "Config",
    "ConfigError",
    "DEFAULT_PRESET",
    "from_yaml",
    "list_presets",
    "load_config",
    "to_yaml",
    "validate",
]
