"""A tier's Options from strings: the one conversion the command line and the panel share.

Every field of a tier's ``Options`` dataclass has one of five kinds, read from its
annotation: ``bool``, ``int``, ``float``, ``str`` or ``tuple`` (``tuple[str, ...]``,
written comma-separated: ``sigkill:7:1,exception:12:0``). ``parse`` turns a string
into a field's value, ``format`` a value back into the string ``parse`` reads, and
``build`` makes the Options from a mapping of strings or values; a value that does
not fit raises ``OptionError`` naming the field, e.g. ``bucket_cap_mb='abc': expected
a number (float)``.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["KINDS", "OptionError", "build", "fields", "format", "kind", "parse"]

KINDS = ("bool", "int", "float", "str", "tuple")
TRUE = ("true", "1", "yes")
FALSE = ("false", "0", "no")
_EXPECTED = {"bool": "expected a boolean (true/false, 1/0, yes/no)",
             "int": "expected an integer (int)", "float": "expected a number (float)"}
_BY_NAME = {"bool": "bool", "int": "int", "float": "float", "str": "str"}


class OptionError(ValueError):
    """A value that does not fit its field; ``str()`` is ``NAME=RAW: reason`` (prefix it with where it came from)."""

    def __init__(self, name: str, raw: Any, reason: str) -> None:
        self.name, self.raw, self.reason = name, raw, reason
        super().__init__(f"{name}={raw}: {reason}")


def _kind_of(annotation: Any) -> str | None:
    """The kind of a resolved annotation, or of its string form (``from __future__ import annotations``)."""
    if isinstance(annotation, str):
        text = annotation.replace(" ", "")
        if text.startswith(("tuple[", "Tuple[", "typing.Tuple[")):
            return "tuple"
        return _BY_NAME.get(text)
    if typing.get_origin(annotation) is tuple or annotation is tuple:
        return "tuple"
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(annotation)


def _hints(options_cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(options_cls)
    except Exception:  # an annotation that does not resolve: fall back to each field's text
        return {}


@functools.cache
def _fields(options_cls: type) -> tuple[tuple[str, str], ...]:
    hints = _hints(options_cls)
    out = []
    for f in dataclasses.fields(options_cls):
        found = _kind_of(hints.get(f.name, f.type)) or _kind_of(f.type)
        if found is None and f.default is not dataclasses.MISSING:
            found = _kind_of(type(f.default))
        if found is None:
            raise TypeError(f"{options_cls.__qualname__}.{f.name}: type {f.type!r} is not one of {', '.join(KINDS)}")
        out.append((f.name, found))
    return tuple(out)


def fields(options_cls: type) -> dict[str, str]:
    """Field name -> kind, in declaration order (TypeError for a field of another type)."""
    return dict(_fields(options_cls))


def kind(options_cls: type, name: str) -> str:
    """The kind of one field (ValueError listing the fields if there is none called ``name``)."""
    known = fields(options_cls)
    if name not in known:
        raise ValueError(f"unknown option {name!r}: {_takes(options_cls)}")
    return known[name]


def _takes(options_cls: type) -> str:
    names = list(fields(options_cls))
    return f"this tier takes {', '.join(names)}" if names else "this tier takes no options"


def parse(kind_: str, raw: str, name: str = "value") -> Any:
    """``raw`` as a value of ``kind_`` (OptionError naming ``name`` if it is not one)."""
    text = raw.strip()
    if kind_ == "bool":
        if text.lower() in TRUE or text.lower() in FALSE:
            return text.lower() in TRUE
        raise OptionError(name, raw, _EXPECTED["bool"])
    if kind_ in ("int", "float"):
        try:
            return int(text) if kind_ == "int" else float(text)
        except ValueError:
            raise OptionError(name, raw, _EXPECTED[kind_]) from None
    if kind_ == "tuple":
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if kind_ == "str":
        return raw
    raise ValueError(f"unknown kind {kind_!r}: choose one of {', '.join(KINDS)}")


def format(value: Any) -> str:  # noqa: A001 - the inverse of parse, named as such
    """The string ``parse`` turns back into ``value``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple | list):
        return ",".join(format(v) for v in value)
    return str(value)


def coerce(options_cls: type, name: str, value: Any) -> Any:
    """One field's value from a string (parsed) or a value (checked against the field's kind)."""
    kind_ = kind(options_cls, name)
    if isinstance(value, str):
        return parse(kind_, value, name)
    ok = {"bool": isinstance(value, bool), "int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, int | float) and not isinstance(value, bool),
          "tuple": isinstance(value, tuple | list)}.get(kind_, False)
    if not ok:
        raise OptionError(name, repr(value), _EXPECTED.get(kind_, f"expected a {kind_}"))
    if kind_ == "float":
        return float(value)
    return tuple(str(v) for v in value) if kind_ == "tuple" else value


def build(options_cls: type, values: Mapping[str, Any]) -> Any:
    """``options_cls(**values)``, each value parsed or checked first (OptionError / ValueError naming the field)."""
    return options_cls(**{name: coerce(options_cls, name, value) for name, value in values.items()})
