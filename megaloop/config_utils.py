"""Typed dataclass configs: YAML loading and ``a.b=c`` dotlist overrides.

Every config section is a dataclass validated in ``__post_init__``; errors are ``ConfigError``
and name the offending field (``model.num_heads``), so bad input fails before any compute.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
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


class _DuplicateKeyError(yaml.YAMLError):
    """A mapping names a key twice (YAML would silently keep the last value)."""

    def __init__(self, key: Any, mark: Any, first: Any) -> None:
        super().__init__()
        self.key, self.mark, self.first = key, mark, first

    def __str__(self) -> str:
        return (f"duplicate key {self.key!r} (line {self.mark.line + 1}, column {self.mark.column + 1}; "
                f"first given on line {self.first.line + 1})")


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (``_DuplicateKeyError``). Each
    mapping node is checked once, before ``<<:`` merge keys rewrite it in place (a shared anchor used
    through a nested merge would otherwise show the merged keys beside its own)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()

    def _check_unique(self, node: Any) -> None:
        if not isinstance(node, yaml.MappingNode) or id(node) in self._checked:
            return
        self._checked.add(id(node))
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges; keys given beside it override the merged ones
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:
                continue  # unhashable key: SafeLoader names it below
            if first is not key_node.start_mark:
                raise _DuplicateKeyError(key, key_node.start_mark, first)

    def flatten_mapping(self, node: Any) -> None:
        self._check_unique(node)
        for key_node, value_node in node.value:  # merged mappings before they are flattened themselves
            if key_node.tag == "tag:yaml.org,2002:merge":
                for sub in (value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]):
                    self._check_unique(sub)
        super().flatten_mapping(node)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        self._check_unique(node)
        return super().construct_mapping(node, deep)


# PyYAML's constructors raise these (not YAMLError) on a tag with a value it cannot take:
# ``!!int`` alone, ``!!float abc``, ``!!bool x``, ``!!timestamp x``
_CONSTRUCT_ERRORS = (ValueError, IndexError, KeyError, AttributeError, TypeError, OverflowError)


def yaml_error_text(err: yaml.YAMLError) -> str:
    """One line for a PyYAML error: ``not valid YAML (line L, column C): problem`` (no place when
    PyYAML gives no mark). Config files, experiment files and mix-weights files word it alike."""
    mark = getattr(err, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"not valid YAML{where}: {getattr(err, 'problem', None) or (str(err).splitlines() or [''])[0]}"


def _raw_text(text: str) -> Any:
    """``text`` read as YAML with every scalar kept as the text typed (``0123``, ``yes``); None when
    that reading fails (it only supplies text fields' values; the typed reading reports errors)."""
    try:
        return yaml.load(text, Loader=yaml.BaseLoader)
    except (yaml.YAMLError, *_CONSTRUCT_ERRORS):
        return None


def keep_text(data: Any, raw: Any, cls: Any) -> Any:
    """``data`` (a typed YAML reading of a mapping for dataclass ``cls``) with each ``str`` field's
    value as typed in ``raw`` (the same mapping read as text): YAML 1.1 reads ``name: 0123`` as
    83, ``yes`` as True and ``2024_01`` as 202401, which a text field would then record. Nested
    sections likewise; renamed fields under either name; anything else as it was."""
    if not (isinstance(data, dict) and isinstance(raw, dict) and dataclasses.is_dataclass(cls)):
        return data
    hints = typing.get_type_hints(cls)
    renamed = getattr(cls, "RENAMED", {})
    out = dict(data)
    for key, value in data.items():
        tp = hints.get(renamed.get(key, key)) if isinstance(key, str) else None
        if key not in raw or tp is None:
            continue
        if dataclasses.is_dataclass(tp):
            out[key] = keep_text(value, raw[key], tp)
        elif _is_text_field(tp) and value is not None and not isinstance(value, (str, dict, list)) \
                and isinstance(raw[key], str):
            out[key] = raw[key]
    return out


def _parse_scalar(text: str) -> Any:
    """Parse a dotlist value with YAML rules (``1e-3`` -> float, ``[1,2]`` -> list, ``null``)."""
    value = yaml.load(text, Loader=_UniqueKeyLoader)
    # YAML 1.1 reads "1e-3" as a string; accept it as a float like every other CLI does.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


_NULLS = ("", "~", "null", "Null", "NULL")


def _is_text_field(tp: Any) -> bool:
    """``str`` or ``str | None``: a field whose override keeps its text."""
    if tp is str:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)] == [str]
    return False


def _override_text(text: str, parsed: Any) -> Any:
    """A ``str`` field's value from its override text: the text, less one pair of matching quotes;
    ``None`` where YAML reads it as null (``null``, ``~``, nothing)."""
    text = text.strip()
    if parsed is None and text in _NULLS:
        return None
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


# a number in exponent form that YAML 1.1 (PyYAML) reads as text: 1e-3, 3E4, 1.0e3, -2.5e+2
_EXPONENT_NUMBER = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+")


def _number(value: Any) -> Any:
    """``value``, or the float an exponent-form text means (``lr: 1e-3`` in a YAML file or a section
    mapping override reaches a number field as the string "1e-3")."""
    if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        return float(value)
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
    if tp in (int, float):
        value = _number(value)
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
            close = difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.7)
            hint = f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else ""
            raise ConfigError(f"{where}: unknown field (known: {', '.join(sorted(names))}){hint}")
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


def use_new_names(dotlist: list[str], renames: dict[str, str]) -> list[str]:
    """``dotlist`` with old field names replaced by new ones, so an arm and overrides that mix old and
    new names of a field set one field (last one wins); YAML files are renamed as they are read
    (``load_yaml(renames=...)``)."""
    out = []
    for item in dotlist:
        key, eq, text = item.partition("=")
        out.append(f"{renames.get(key.strip(), key.strip())}{eq}{text}" if eq else item)
    return out


def _set_override(node: dict, key: str, value: Any) -> None:
    """Set ``node[key]`` to an override's value; a mapping given for a section merges into it key by
    key (``train={max_steps: 40}`` keeps the section's other keys)."""
    if isinstance(value, dict) and isinstance(node.get(key), dict):
        for k, v in value.items():
            _set_override(node[key], k, v)
    else:
        node[key] = value


def _field_type(cls: Any, parts: list[str]) -> Any:
    """The annotated type of the field ``parts`` names under dataclass ``cls`` (None: not known)."""
    for i, part in enumerate(parts):
        if cls is None or not dataclasses.is_dataclass(cls):
            return None
        renamed = getattr(cls, "RENAMED", {})
        tp = typing.get_type_hints(cls).get(renamed.get(part, part))
        if i == len(parts) - 1:
            return tp
        cls = tp
    return None


def _new_names(value: dict, cls: type, where: str) -> dict:
    """A mapping given for section ``cls`` (dotted path ``where``) with renamed fields under their new
    names, nested sections too."""
    renamed, hints = getattr(cls, "RENAMED", {}), typing.get_type_hints(cls)
    old_of = {new: old for old, new in renamed.items()}
    out = {}
    for k, v in value.items():
        new = renamed.get(k, k)
        if new in out:
            raise ConfigError(f"{where}.{old_of[new]}: renamed to {where}.{new}; give only one of them")
        tp = hints.get(new)
        out[new] = _new_names(v, tp, f"{where}.{new}") if isinstance(v, dict) and dataclasses.is_dataclass(tp) else v
    return out


def apply_dotlist(data: dict, dotlist: list[str], cls: Any = None) -> dict:
    """Apply ``a.b=c`` overrides to a nested dict (in place) and return it. Values read as YAML
    (``1e-3`` -> float, ``[1,2]`` -> list, ``null``), except that a ``str`` field of dataclass
    ``cls`` keeps the text as typed (``logging.name=0123`` is "0123", not 83); a mapping given for a
    section merges into it."""
    for item in dotlist:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value (e.g. train.max_steps=20)")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(p.strip() for p in parts):
            what = "has no key" if not key.strip() else f"has an empty name in key {key.strip()!r}"
            raise ConfigError(f"override {item!r} {what}: expected section.key=value (e.g. train.max_steps=20)")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {p} is not a section")
        try:
            value = _parse_scalar(text)
        except (yaml.YAMLError, *_CONSTRUCT_ERRORS) as e:
            raise ConfigError(f"override {key}: {text!r} is not a valid YAML value "
                              f"({(str(e).splitlines() or [type(e).__name__])[0]})") from None
        tp = _field_type(cls, parts)
        if _is_text_field(tp):
            value = _override_text(text, value)  # the override as typed, not as YAML reads it
        elif isinstance(value, dict) and dataclasses.is_dataclass(tp):
            value = keep_text(value, _raw_text(text), tp)  # its text fields as typed, as above
            value = _new_names(value, tp, key.strip())  # merges into the section, whose keys already have the new names
        _set_override(node, parts[-1], value)
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


def load_yaml(path: str | Path, _chain: tuple[Path, ...] = (), renames: dict[str, str] | None = None,
              cls: Any = None) -> dict:
    """Read a YAML mapping; a file may name ``base: other.yaml`` (resolved beside it) to inherit.
    A key given twice in one mapping, a ``base`` that is not a file name, names no file, or leads
    back to a file already on the chain (a cycle) are ``ConfigError``s naming the file. ``renames``
    (old dotted path → new) renames old keys in each file before it merges with its base, so a
    file's new name overrides its base's old one; one mapping holding both names is refused. With
    ``cls`` (the dataclass the mapping is for), text fields keep their values as typed
    (:func:`keep_text`)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text()
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except _DuplicateKeyError as e:
        raise ConfigError(f"config file {path}: {e}; give each key once") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: {yaml_error_text(e)}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except _CONSTRUCT_ERRORS as e:  # a tag with a value it cannot take (`max_steps: !!float abc`)
        raise ConfigError(f"config file {path}: not valid YAML: a tagged value cannot be read "
                          f"({(str(e).splitlines() or [type(e).__name__])[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    base = data.pop("base", None)
    raw = _raw_text(text) if cls is not None else None
    if renames:
        _rename_in_file(data, renames, path)
        if isinstance(raw, dict):
            try:
                _rename_in_file(raw, renames, path)
            except ConfigError:
                raw = None
    if cls is not None:
        data = keep_text(data, raw, cls)
    if base:
        if not isinstance(base, str):
            raise ConfigError(f"config file {path}: base: expected a YAML file name (resolved beside it), "
                              f"got {base!r}")
        chain = (*_chain, path)
        parent = path.parent / base
        resolved = [p.resolve() for p in chain]
        if parent.resolve() in resolved:  # the files from the first repeated one, in order
            cycle = (*chain[resolved.index(parent.resolve()):], parent)
            raise ConfigError(f"config file {path}: base: cycle {' -> '.join(map(str, cycle))}")
        if not parent.is_file():
            what = "a directory" if parent.is_dir() else "no such file"
            raise ConfigError(f"config file {path}: base: {base!r} is {what} (looked for {parent}, "
                              f"beside {path.name}; give a YAML file's name or path)")
        data = merge(load_yaml(parent, chain, renames, cls), data)
    return data


def _rename_in_file(data: dict, renames: dict[str, str], path: Path) -> None:
    """Rename ``renames``' old keys of one file's mapping in place; both names in one mapping is a
    ``ConfigError`` naming the file and both keys."""
    for old, new in renames.items():
        *parents, key = old.split(".")
        node = data
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and key in node:
            new_key = new.rsplit(".", 1)[-1]
            if new_key in node:
                raise ConfigError(f"config file {path}: {old}: renamed to {new}; give only one of them")
            node[new_key] = node.pop(key)
