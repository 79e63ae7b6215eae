"""Load a YAML config, apply dotted ``key.sub=value`` overrides, validate against the schema.

Override values are parsed as YAML scalars (``16`` -> int, ``1e-3`` -> float, ``null`` -> None,
``[2, 1]`` -> list), so the command line accepts the same spellings as the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dpgs.config.schema import Config
from dpgs.outputs import write_text_atomically


class ConfigError(ValueError):
    """A config file or override is invalid; the message names every offending key."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into its key path and YAML-parsed value."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override '{key}': cannot parse value {raw!r}: {err}") from err
    return key.split("."), value


def apply_override(tree: dict, path: list[str], value: Any) -> None:
    """Set ``tree[path[0]][path[1]]... = value``, creating intermediate mappings.

    ``model.params`` is free-form (head hyper-parameters), so keys below it are created as given and
    checked later against the head's constructor.
    """
    node = tree
    for depth, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            dotted = ".".join(path[: depth + 1])
            raise ConfigError(f"override '{'.'.join(path)}': '{dotted}' is a value, not a section")
        node = child
    node[path[-1]] = value


def format_validation_error(err: ValidationError) -> str:
    """One line per problem: ``key.path: message``."""
    lines = []
    for item in err.errors():
        key = ".".join(str(p) for p in item["loc"]) or "<config>"
        msg = "unknown key" if item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"  {key}: {msg}")
    return "invalid configuration:\n" + "\n".join(lines)


def config_from_dict(tree: dict) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read ``path`` (YAML) if given, apply ``overrides`` in order and validate."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from err
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        tree = loaded or {}
    for text in overrides:
        key_path, value = parse_override(text)
        apply_override(tree, key_path, value)
    try:
        return config_from_dict(tree)
    except ConfigError as err:
        where = f" ({path})" if path is not None else ""
        raise ConfigError(f"{err}{where}") from None


def config_to_dict(config: Config) -> dict:
    """Plain YAML-safe dict (paths as strings)."""
    return config.model_dump(mode="json")


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{'train': {'lr': 1e-3}}`` -> ``{'train.lr': 1e-3}`` (used for MLflow params)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def save_config(config: Config, path: str | Path) -> None:
    """Write ``config`` as YAML to ``path`` atomically (a reader never sees half a file)."""
    write_text_atomically(path, yaml.safe_dump(config_to_dict(config), sort_keys=False))
