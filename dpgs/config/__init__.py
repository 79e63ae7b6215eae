"""Configuration: schema, YAML loading and dotted command-line overrides."""

from dpgs.config.loader import (
    ConfigError,
    config_from_dict,
    config_to_dict,
    flatten,
    load_config,
    save_config,
)
from dpgs.config.schema import Config

__all__ = [
    "Config",
    "ConfigError",
    "config_from_dict",
    "config_to_dict",
    "flatten",
    "load_config",
    "save_config",
]
