"""Checks of settings values: attrs' own validators, kvroute's messages; and the one ``KEY=VALUE`` parser.

`expect` runs a chain of ``attrs.validators`` checks (``instance_of``, ``gt``, ``ge``, ``le``...)
and, when one fails, raises `ConfigError` (or the ``error`` given) in the house format, saying
what the field must be and what it got: ``'rate' must be a positive number (got -1).`` attrs'
own messages would name Python classes and raise `TypeError` for a value of the wrong type,
which a command would show as a traceback instead of an error line. Each caller words ``what``
itself, so every setting keeps the message its users know.

Numbers are ints or floats, never bools (``True`` is an ``int`` to Python, not a count to a
user). `NUMBER` lets the infinities through, `FINITE_NUMBER` does not; NaN fails any bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import attrs
from attrs import validators as v

from kvroute.errors import ConfigError

__all__ = [
    "FINITE_NUMBER",
    "INTEGER",
    "NUMBER",
    "Validator",
    "expect",
    "flag",
    "integer",
    "non_negative_number",
    "optional",
    "parse_key_values",
    "positive_integer",
    "positive_number",
    "positive_share",
    "share",
]

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]

_NOT_BOOL = v.not_(v.instance_of(bool))
#: An ``int``, not a ``bool``.
INTEGER: tuple[Validator, ...] = (v.instance_of(int), _NOT_BOOL)
#: An ``int`` or a ``float``, not a ``bool``.
NUMBER: tuple[Validator, ...] = (v.instance_of((int, float)), _NOT_BOOL)
#: A `NUMBER` that is finite: NaN fails both comparisons, the infinities one each.
FINITE_NUMBER: tuple[Validator, ...] = (*NUMBER, v.gt(-math.inf), v.lt(math.inf))


def expect(what: str, *checks: Validator, error: type[Exception] = ConfigError) -> Validator:
    """A validator running the attrs ``checks`` in order; the first that fails raises
    ``error("'<field>' must be <what> (got <value>).")``."""
    check = v.and_(*checks)

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        try:
            check(instance, attribute, value)
        except (TypeError, ValueError):
            raise error(f"'{attribute.name}' must be {what} (got {value!r}).") from None

    return validate


def optional(validator: Validator) -> Validator:
    """``validator``, letting ``None`` through (``attrs.validators.optional``, typed for fields with a non-None
    default)."""
    return v.optional(validator)


positive_number = expect("a positive number", *FINITE_NUMBER, v.gt(0))
non_negative_number = expect("a number >= 0", *FINITE_NUMBER, v.ge(0))
share = expect("a number between 0 and 1", *FINITE_NUMBER, v.ge(0), v.le(1))
positive_share = expect("a number above 0 and at most 1", *FINITE_NUMBER, v.gt(0), v.le(1))
positive_integer = expect("a positive integer", *INTEGER, v.gt(0))
integer = expect("an integer", *INTEGER)
flag = expect("true or false", v.instance_of(bool))


def parse_key_values(items: Iterable[str], bad: Callable[[str], Exception]) -> list[tuple[str, str]]:
    """Parse repeated ``KEY=VALUE`` arguments into ``(key, value)`` pairs, in order.

    Keys and values are stripped and ``-`` in a key becomes ``_`` (``prefix-length=4096`` is
    ``prefix_length``), so an option is spelled as its field or as its flag. A qualifier before
    the key's last dot (the strategy of ``bounded-load.load-factor=2``) is a name, kept as written.
    An item without ``=`` or with an empty key raises ``bad(item)``: each command words its own message.
    """
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise bad(item)
        name, dot, option = key.strip().rpartition(".")
        pairs.append((f"{name}{dot}{option.replace('-', '_')}", value.strip()))
    return pairs
