"""How a wire struct becomes a msgpack array and back (bus/messages.py declares every struct).

A struct is a dataclass whose fields are encoded as an array in declaration order, nested structs likewise
as arrays. A decoder fills missing trailing fields from their defaults and ignores extra ones.

Decoding checks every field against its declared type (``int`` is a 64-bit integer and never a bool, a
``float`` may arrive as an integer, ``list[int]`` holds only such integers, ``X | None`` may be nil), so a
message that decodes is one no receiver can trip over: a wrong type is a ProtocolError like a wrong
length. What a field's value means (a token id inside the vocabulary, a positive temperature) is checked
where that is known: ``AddRequest.problem`` in the scheduler.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar


class ProtocolError(ValueError):
    """A frame that is not a valid message of this wire version."""


# (owner class name, field name) -> (nested message class, is a list of them)
_NESTED: dict[tuple[str, str], tuple[type, bool]] = {}

_INT_MIN, _INT_LIMIT = -(2 ** 63), 2 ** 64  # msgpack's integers: int64 and uint64


def _is_int(value: Any) -> bool:
    return type(value) is int and _INT_MIN <= value < _INT_LIMIT


def _all_ints(values: list) -> bool:
    return all(type(v) is int for v in values) and (not values or (min(values) >= _INT_MIN
                                                                    and max(values) < _INT_LIMIT))


_SCALAR_CHECKS = {
    "int": _is_int,
    "float": lambda v: type(v) is float or _is_int(v),
    "str": lambda v: type(v) is str,
    "bytes": lambda v: type(v) is bytes,
    "bool": lambda v: type(v) is bool,
    "list": lambda v: type(v) is list,
}


def _type_check(annotation: str):
    """A predicate over a decoded value of a field declared ``annotation``; None for a nested struct
    (its own from_wire checks it)."""
    base = annotation.removesuffix(" | None")
    optional = base != annotation
    if base == "list[int]":
        check = lambda v: type(v) is list and _all_ints(v)  # noqa: E731 - the hot path's long lists
    elif base.startswith("list["):
        item = _type_check(base[len("list["):-1])
        if item is None:
            return None
        check = lambda v: type(v) is list and all(item(x) for x in v)  # noqa: E731
    else:
        check = _SCALAR_CHECKS.get(base)
        if check is None:
            return None
    return (lambda v: v is None or check(v)) if optional else check


_TYPE_CHECKS: dict[type, list] = {}  # message class -> [(field, predicate or None)], built on first use


def _field_checks(cls: type) -> list:
    checks = _TYPE_CHECKS.get(cls)
    if checks is None:
        checks = _TYPE_CHECKS[cls] = [(f, _type_check(f.type)) for f in dataclasses.fields(cls)]
    return checks


class Message:
    """Base of every wire struct: array encoding in field order, defaults for missing trailing fields."""

    KIND: ClassVar[int]  # messages.Kind: frame 0

    def to_wire(self) -> list:
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            nested = _NESTED.get((type(self).__name__, f.name))
            if nested is not None and value is not None:
                value = [v.to_wire() for v in value] if nested[1] else value.to_wire()
            out.append(value)
        return out

    @classmethod
    def from_wire(cls, values: Any):
        if not isinstance(values, (list, tuple)):
            raise ProtocolError(f"{cls.__name__}: expected an array, got {type(values).__name__}")
        checks = _field_checks(cls)
        kwargs = {}
        for (f, check), value in zip(checks, values):
            if check is not None and not check(value):
                raise ProtocolError(f"{cls.__name__}.{f.name}: {type(value).__name__} {_clip(value)} is not "
                                    f"{f.type}")
            nested = _NESTED.get((cls.__name__, f.name))
            if nested is not None and value is not None:  # None: an optional nested struct left out
                nested_cls, many = nested
                if many:
                    if not isinstance(value, list):
                        raise ProtocolError(f"{cls.__name__}.{f.name}: expected an array")
                    value = [nested_cls.from_wire(v) for v in value]
                else:
                    value = nested_cls.from_wire(value)
            kwargs[f.name] = value
        missing = [f for f, _ in checks[len(values):] if f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ProtocolError(f"{cls.__name__}: missing required field {missing[0].name!r}")
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ProtocolError(f"{cls.__name__}: {e}") from None


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def register_nested(owner: str, name: str, cls: type, many: bool = False) -> None:
    """Field ``name`` of struct ``owner`` holds a ``cls`` (a list of them with ``many``)."""
    _NESTED[(owner, name)] = (cls, many)
