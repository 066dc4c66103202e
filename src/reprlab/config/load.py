"""Strict loading of nested frozen dataclasses from YAML dicts plus dotted ``key=value`` overrides.

Errors name the full key path, the valid keys and the closest match, because a silently ignored typo in a
hyper-parameter is the most expensive bug a research run can have.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from reprlab.errors import ConfigError  # re-exported as reprlab.config.ConfigError

T = TypeVar("T")


def _valid_keys_msg(path: str, key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    where = f" in {path!r}" if path else ""
    return f"unknown config key {key!r}{where}{hint} Valid keys: {', '.join(sorted(valid))}"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert ``value`` (from YAML or an override string) to type ``tp`` or raise :class:`ConfigError`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping for {_type_name(tp)}, got {value!r}")
        return _build(tp, value, path)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        raise ConfigError(f"{path}: expected one of {list(choices)}, got {value!r}")
    if origin in (tuple, list):
        if isinstance(value, str):
            value = (
                yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
            )
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list for {_type_name(tp)}, got {value!r}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            items = [_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            inner = args[0] if args else Any
            items = [_coerce(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ConfigError(f"{path}: expected bool, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected int, got bool {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if float(value).is_integer() else int(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected int, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}: expected str, got {value!r}")
    return value


def _build(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(_valid_keys_msg(path, key, list(fields)))
        full = f"{path}.{key}" if path else key
        kwargs[key] = _coerce(value, hints[key], full)
        _check_range(fields[key], kwargs[key], full)
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required field without default that the YAML did not set
        raise ConfigError(f"{path or cls.__name__}: {err}") from err


def _check_range(f: dataclasses.Field, value: Any, path: str) -> None:
    """Ranges and choices from field metadata (``ge``, ``gt``, ``le``, ``lt``, ``choices``).

    Every ``batch_size`` field must be at least 1 without saying so: a batch of 0 only fails deep inside a
    data loader, after the run folder exists.
    """
    meta = dict(f.metadata)
    if (f.name == "batch_size" or f.name.endswith("_batch_size")) and "ge" not in meta and "gt" not in meta:
        meta["ge"] = 1
    if value is None or isinstance(value, bool):
        return
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{path}: expected one of {list(meta['choices'])}, got {value!r}")
    if not isinstance(value, int | float):
        return
    for op, ok, words in (
        ("ge", value >= meta.get("ge", value), ">="),
        ("gt", "gt" not in meta or value > meta["gt"], ">"),
        ("le", value <= meta.get("le", value), "<="),
        ("lt", "lt" not in meta or value < meta["lt"], "<"),
    ):
        if op in meta and not ok:
            raise ConfigError(f"{path}: must be {words} {meta[op]}, got {value!r}")


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """Turn ``["train.lr=3e-4", "seed=1"]`` into a nested dict of raw strings (typed later)."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.lr=3e-4)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r} has an empty key part")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override of {part!r}")
        node[parts[-1]] = _parse_scalar(raw)
    return nested


def _parse_scalar(raw: str) -> Any:
    # YAML gives the user's intent for lists and numbers ("[1,2]", "1e-3"); strings stay strings otherwise.
    if not raw.strip():
        return ""  # `key=` means the empty string (YAML would say None); `key=null` is None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, dict):
        return raw
    if isinstance(value, int | float) and not isinstance(value, bool):
        # YAML 1.1 reads "2:3" as the base-60 number 123 and "0x10" as 16: only plain numbers are numbers
        try:
            float(raw.strip())
        except ValueError:
            return raw
    return value


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _check_override_paths(cls: type, overrides: Mapping[str, Any], path: str = "") -> None:
    """Validate override keys against the dataclass tree even where the YAML did not mention them."""
    hints = get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    for key, value in overrides.items():
        full = f"{path}.{key}" if path else key
        if key not in fields:
            raise ConfigError(_valid_keys_msg(path, key, list(fields)))
        tp = hints[key]
        if isinstance(value, Mapping):
            if dataclasses.is_dataclass(tp):
                _check_override_paths(tp, value, full)
            elif get_origin(tp) is not dict:
                raise ConfigError(f"{full} is a {_type_name(tp)}, not a group of keys")


def load_config(cls: type[T], data: Mapping[str, Any] | None = None, overrides: Iterable[str] = ()) -> T:
    """Build a frozen dataclass config from a mapping plus dotted overrides.

    Args:
        cls: the root config dataclass.
        data: nested mapping, typically ``yaml.safe_load`` of a recipe's ``config:`` block.
        overrides: ``key=value`` strings with dotted paths (``train.lr=3e-4``), applied on top.

    Raises:
        ConfigError: unknown key (names valid keys and the closest match) or wrong type (names the full
            key path and the expected type).
    """
    parsed = parse_overrides(overrides)
    _check_override_paths(cls, parsed)
    merged = _merge(dict(data or {}), parsed)
    return _build(cls, merged)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) suitable for YAML/JSON."""

    def plain(x: Any) -> Any:
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, list | tuple):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(cfg)


def field_help(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """``(dotted key, type, default, help)`` rows for every leaf field, for CLI help."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(field_help(tp, key + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # fmt: skip
        rows.append((key, _type_name(tp), default, f.metadata.get("help", "")))
    return rows


def _lookup(nested: Mapping[str, Any] | None, dotted: str) -> tuple[bool, Any]:
    node: Any = nested
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def resolved_rows(
    cls: type, cfg: Any, layers: Iterable[tuple[str, Mapping[str, Any] | None]]
) -> list[dict[str, Any]]:
    """Every leaf key of ``cfg`` with its value, its source and, where they differ, its dataclass default.

    Args:
        cls: the root config dataclass.
        cfg: the resolved config (an instance of ``cls``).
        layers: ``(source name, nested mapping)`` in the order they are applied (e.g. ``recipe``, ``demo``,
            ``override``); a key's source is the last layer that sets it, else ``default``.

    Returns:
        ``{"key", "value", "source", "default", "differs", "type", "help"}`` per leaf, in field order.
    """
    layers = list(layers)
    rows = []
    for key, tp, default, help_text in field_help(cls):
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        source = "default"
        for name, nested in layers:
            if _lookup(nested, key)[0]:
                source = name
        plain = config_to_dict(value) if isinstance(value, list | tuple | dict) else value
        dflt = config_to_dict(default) if isinstance(default, list | tuple | dict) else default
        rows.append({"key": key, "value": plain, "source": source, "default": dflt, "differs": plain != dflt,
                     "type": tp, "help": help_text})  # fmt: skip
    return rows


def format_value(value: Any) -> str:
    """A value as one would type it in a ``key=value`` override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value and value.strip() == value and "," not in value else repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)
