"""Field validators for the simulator's attrs classes: attrs' own checks, kvroute's messages.

Each validator runs a chain of ``attrs.validators`` checks (``instance_of``, ``gt``, ``ge``,
``le``...) and, when one fails, raises `ConfigError` in the house format, saying what the
field must be and what it got: ``'rate' must be a positive number (got -1).`` attrs' own
messages would name Python classes and raise `TypeError` for a value of the wrong type,
which ``kvroute simulate`` would show as a traceback instead of an error line.

Numbers are ints or floats, never bools (``True`` is an ``int`` to Python, not a count to a
user), and finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
from attrs import validators as v

from kvroute.errors import ConfigError

__all__ = [
    "expect",
    "flag",
    "integer",
    "non_negative_number",
    "optional",
    "positive_integer",
    "positive_number",
    "positive_share",
    "share",
]

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]

_NOT_BOOL = v.not_(v.instance_of(bool))
_INTEGER = (v.instance_of(int), _NOT_BOOL)
# NaN fails both comparisons, the infinities one each.
_NUMBER = (v.instance_of((int, float)), _NOT_BOOL, v.gt(-math.inf), v.lt(math.inf))


def expect(what: str, *checks: Any, error: type[Exception] = ConfigError) -> Validator:
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


positive_number = expect("a positive number", *_NUMBER, v.gt(0))
non_negative_number = expect("a number >= 0", *_NUMBER, v.ge(0))
share = expect("a number between 0 and 1", *_NUMBER, v.ge(0), v.le(1))
positive_share = expect("a number above 0 and at most 1", *_NUMBER, v.gt(0), v.le(1))
positive_integer = expect("a positive integer", *_INTEGER, v.gt(0))
integer = expect("an integer", *_INTEGER)
flag = expect("true or false", v.instance_of(bool))
