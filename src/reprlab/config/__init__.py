"""Typed configs: frozen dataclasses are the source of truth; YAML and ``key=value`` overrides compose them."""

from reprlab.config.load import ConfigError, config_to_dict, load_config, parse_overrides

__all__ = ["ConfigError", "config_to_dict", "load_config", "parse_overrides"]
