"""Typed dataclass configs: YAML loading and ``a.b=c`` dotlist overrides.

Every config section is a dataclass validated in ``__post_init__``; errors are ``ConfigError``
and name the offending field (``model.num_heads``), so bad input fails before any compute.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Sequence

import yaml

from megaloop.errors import UserError


class ConfigError(UserError, ValueError):
    """A config value is invalid; the message names the field."""


def check_keys(mapping: dict, known: Sequence[str], where: str, error: type[Exception] = ConfigError) -> None:
    """Raise ``error`` naming ``where`` and every key of ``mapping`` that is not in ``known``."""
    unknown = sorted(map(str, set(mapping) - set(known)))
    if unknown:
        raise error(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(known)})")


def require(cond: bool, field: str, msg: str) -> None:
    """Raise ``ConfigError("field: msg")`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{field}: {msg}")


def _parse_scalar(text: str) -> Any:
    """Parse a dotlist value with YAML rules (``1e-3`` -> float, ``[1,2]`` -> list, ``null``)."""
    value = yaml.safe_load(text)
    # YAML 1.1 reads "1e-3" as a string; accept it as a float like every other CLI does.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _coerce(value: Any, tp: Any, field: str) -> Any:
    """Coerce a YAML/dotlist value to the annotated type ``tp`` or raise naming ``field``."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        for a in args:
            try:
                return _coerce(value, a, field)
            except ConfigError:
                continue
        raise ConfigError(f"{field}: cannot read {value!r} as {tp}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{field}: expected a mapping, got {value!r}")
        return from_dict(tp, value, prefix=field)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{field}: expected a list, got {value!r}")
        (inner,) = typing.get_args(tp)[:1] or (Any,)
        items = [_coerce(v, inner, f"{field}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict or tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{field}: expected true/false, got {value!r}")
    if tp is int:
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or int(value) != value):
            raise ConfigError(f"{field}: expected an integer, got {value!r}")
        return int(value)
    if tp is float:  # no setting takes inf or nan (an overflowed or mistyped value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{field}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{field}: expected a string, got {value!r}")
        return str(value)
    return value


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict; unknown keys are errors naming the key. A field
    renamed in a later release is still read under its old name (``cls.RENAMED``: old → new), so
    older YAMLs, overrides and checkpoints keep loading."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    for old, new in getattr(cls, "RENAMED", {}).items():
        if old in data:
            where = f"{prefix}." if prefix else ""
            if new in data:
                raise ConfigError(f"{where}{old}: renamed to {where}{new}; give only one of them")
            data = {(new if k == old else k): v for k, v in data.items()}
    for key in data:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else key
            raise ConfigError(f"{where}: unknown field (known: {', '.join(sorted(names))})")
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else key
        kwargs[key] = _coerce(value, hints[key], where)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        if prefix and not str(err).startswith(prefix):
            raise ConfigError(f"{prefix}.{err}") from None
        raise


def to_dict(cfg: Any) -> dict:
    """Nested plain-dict view of a dataclass config (YAML-serialisable)."""
    out = dataclasses.asdict(cfg)

    def fix(v: Any) -> Any:
        if isinstance(v, tuple):
            return [fix(x) for x in v]
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v

    return fix(out)


def renamed_paths(cls: type, prefix: str = "") -> dict[str, str]:
    """Old dotted path → new one for every field renamed in ``cls``'s config tree (``RENAMED``)."""
    out = {f"{prefix}{old}": f"{prefix}{new}" for old, new in getattr(cls, "RENAMED", {}).items()}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(renamed_paths(hints[f.name], f"{prefix}{f.name}."))
    return out


def use_new_names(data: dict, dotlist: list[str], renames: dict[str, str]) -> list[str]:
    """Rename old keys of ``data`` in place and return ``dotlist`` with new keys, so a YAML, an
    arm and overrides that mix old and new names of a field merge as one field (last one wins)."""
    for old, new in renames.items():
        *path, key = old.split(".")
        node = data
        for p in path:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and key in node:
            node[new.rsplit(".", 1)[-1]] = node.pop(key)
    out = []
    for item in dotlist:
        key, eq, text = item.partition("=")
        out.append(f"{renames.get(key.strip(), key.strip())}{eq}{text}" if eq else item)
    return out


def apply_dotlist(data: dict, dotlist: list[str]) -> dict:
    """Apply ``a.b=c`` overrides to a nested dict (in place) and return it."""
    for item in dotlist:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value (e.g. train.max_steps=20)")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {p} is not a section")
        try:
            node[parts[-1]] = _parse_scalar(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key}: {text!r} is not a valid YAML value "
                              f"({str(e).splitlines()[0]})") from None
    return data


def dotlist_settings(dotlist: list[str]) -> dict[str, str | None]:
    """The settings ``key=value`` overrides make: ``{key: value text}``, a key's last value winning, so the
    same overrides in another order make the same settings; an item without ``=``: ``{item: None}``."""
    out: dict[str, str | None] = {}
    for item in dotlist:
        key, eq, text = str(item).partition("=")
        out[key.strip()] = text if eq else None
    return out


def merge(base: dict, over: dict) -> dict:
    """Recursively merge ``over`` into a copy of ``base``."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping; a file may name ``base: other.yaml`` (resolved beside it) to inherit."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"config file {path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    base = data.pop("base", None)
    if base:
        data = merge(load_yaml(path.parent / base), data)
    return data
