"""Typed strategy options: attrs fields that accept strings from the CLI and validate ranges.

Strategy authors declare options as attrs fields built here, so that ``--option
prefix_length=4096`` (a string) and ``prefix_length=4096`` (an int) both work and a bad
value says what was expected and what was got.
"""

from __future__ import annotations

from typing import Any

import attrs
from attrs import validators as v

from kvroute.validators import expect

__all__ = ["bool_option", "float_option", "int_option", "optional_float_option", "optional_int_option", "str_option"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer (got {value!r})")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip().replace("_", ""))
        except ValueError:
            pass
    raise ValueError(f"expected an integer (got {value!r})")


def _to_optional_int(value: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "off")):
        return None
    return _to_int(value)


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number (got {value!r})")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number (got {value!r})") from None


def _to_optional_float(value: Any) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "off")):
        return None
    return _to_float(value)


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"expected true or false (got {value!r})")


def _named(convert: Any) -> Any:
    """Make a converter's error name the option it converts."""

    def run(value: Any, field: attrs.Attribute[Any]) -> Any:
        try:
            return convert(value)
        except ValueError as exc:
            raise ValueError(f"'{field.name}': {exc}.") from None

    return attrs.Converter(run, takes_field=True)


def _range(lo: float | None, hi: float | None) -> Any:
    # "not below lo" rather than ">= lo": the check refuses only what is out of range, as NaN is not.
    checks = []
    if lo is not None:
        checks.append(v.not_(v.lt(lo)))
    if hi is not None:
        checks.append(v.not_(v.gt(hi)))
    if lo is not None and hi is not None:
        bound = f"between {lo} and {hi}"
    elif lo is not None:
        bound = f">= {lo}"
    else:
        bound = f"<= {hi}"
    return v.optional(expect(bound, *checks, error=ValueError))


def int_option(default: int, *, min: int | None = None, max: int | None = None) -> Any:
    """An integer option with an inclusive range."""
    return attrs.field(default=default, converter=_named(_to_int), validator=_range(min, max), kw_only=True)


def optional_int_option(*, min: int | None = None, max: int | None = None) -> Any:
    """An integer option that may be unset (``None``, ``"none"``, ``"off"``)."""
    return attrs.field(default=None, converter=_named(_to_optional_int), validator=_range(min, max), kw_only=True)


def float_option(default: float, *, min: float | None = None, max: float | None = None) -> Any:
    """A float option with an inclusive range."""
    return attrs.field(default=default, converter=_named(_to_float), validator=_range(min, max), kw_only=True)


def optional_float_option(default: float | None = None, *, min: float | None = None, max: float | None = None) -> Any:
    """A float option that may be unset (``None``, ``"none"``, ``"off"``), with an inclusive range."""
    return attrs.field(default=default, converter=_named(_to_optional_float), validator=_range(min, max), kw_only=True)


def bool_option(default: bool) -> Any:
    """A boolean option (accepts true/false/yes/no/on/off/1/0 as strings)."""
    return attrs.field(default=default, converter=_named(_to_bool), kw_only=True)


def str_option(default: str | None = None, *, choices: tuple[str, ...] | None = None) -> Any:
    """A string option, optionally restricted to ``choices``."""

    checks = [expect("a string", v.instance_of(str), error=ValueError)]
    if choices is not None:
        checks.append(expect(f"one of {', '.join(choices)}", v.in_(choices), error=ValueError))
    return attrs.field(default=default, validator=v.optional(checks), kw_only=True)
