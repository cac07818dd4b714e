"""kvroute.validators and kvroute.settings: the checks every setting uses, the one KEY=VALUE parser, and a
setting's click option generated from its field."""

from __future__ import annotations

import math
from typing import Any

import attrs
import click
import pytest
from attrs import validators as v
from click.testing import CliRunner

from kvroute import ConfigError, settings, validators


@attrs.frozen
class _Probe:
    value: Any


def _check(validator: Any, value: Any) -> None:
    validator(_Probe(1), attrs.fields(_Probe).value, value)


class TestValidators:
    @pytest.mark.parametrize(
        ("validator", "good", "bad", "expected"),
        [
            (
                validators.positive_number,
                [1, 0.5, 1e300],
                [0, -1, True, math.nan, math.inf, "1", None],
                "a positive number",
            ),
            (validators.non_negative_number, [0, 0.0, 2.5], [-0.1, False, -math.inf, math.nan, "0"], "a number >= 0"),
            (validators.share, [0, 0.5, 1], [1.01, -0.01, math.nan, True], "a number between 0 and 1"),
            (validators.positive_share, [0.9, 1], [0, 1.5, math.nan, True], "a number above 0 and at most 1"),
            (validators.positive_integer, [1, 10**12], [0, -3, 2.0, 1.5, True, "3", None], "a positive integer"),
            (validators.integer, [0, -5, 7], [1.0, False, "x", None], "an integer"),
            (validators.flag, [True, False], [1, 0, "yes", None], "true or false"),
        ],
    )
    def test_accepts_and_refuses(self, validator: Any, good: list[Any], bad: list[Any], expected: str) -> None:
        """Each validator lets its good values through and refuses the others with a ConfigError saying what was
        expected and got (bools are not numbers, NaN and infinities are refused)."""
        for value in good:
            _check(validator, value)
        for value in bad:
            with pytest.raises(ConfigError) as info:
                _check(validator, value)
            assert str(info.value) == f"'value' must be {expected} (got {value!r}).", value

    def test_optional_lets_none_through(self) -> None:
        """optional(v) accepts None and otherwise checks like v."""
        _check(validators.optional(validators.positive_integer), None)
        with pytest.raises(ConfigError, match=r"^'value' must be a positive integer \(got 0\)\.$"):
            _check(validators.optional(validators.positive_integer), 0)


class TestExpect:
    def test_wording_is_the_callers(self) -> None:
        """expect() words the message with the caller's ``what``, so each setting keeps its own message."""
        check = validators.expect("a number > 0", *validators.NUMBER, v.gt(0))
        with pytest.raises(ConfigError) as info:
            _check(check, 0)
        assert str(info.value) == "'value' must be a number > 0 (got 0)."

    def test_error_class(self) -> None:
        """expect(error=...) raises that class, for callers whose contract is ValueError."""
        check = validators.expect("> 0", v.gt(0), error=ValueError)
        with pytest.raises(ValueError, match=r"^'value' must be > 0 \(got -1\)\.$"):
            _check(check, -1)

    def test_number_allows_infinity_finite_number_does_not(self) -> None:
        """NUMBER lets infinity through (a timeout of inf is 'never'); FINITE_NUMBER refuses it."""
        _check(validators.expect("x", *validators.NUMBER), math.inf)
        with pytest.raises(ConfigError):
            _check(validators.expect("x", *validators.FINITE_NUMBER), math.inf)


class TestParseKeyValues:
    def test_pairs_in_order_with_dashes_normalised(self) -> None:
        """Keys and values are stripped and '-' in a key becomes '_'; order and repeats are kept."""
        pairs = validators.parse_key_values([" prefix-length = 4096", "a=1", "a=2", "empty="], ValueError)
        assert pairs == [("prefix_length", "4096"), ("a", "1"), ("a", "2"), ("empty", "")]

    def test_qualifier_kept_as_written(self) -> None:
        """In NAME.KEY only the key after the last dot is normalised: a strategy name keeps its dashes."""
        pairs = validators.parse_key_values(["bounded-load.load-factor=1.5"], ValueError)
        assert pairs == [("bounded-load.load_factor", "1.5")]

    @pytest.mark.parametrize("item", ["noequals", "=1", " =1"])
    def test_bad_item(self, item: str) -> None:
        """An item without '=' or without a key raises the caller's error for that item."""
        with pytest.raises(KeyError) as info:
            validators.parse_key_values([item], KeyError)
        assert info.value.args == (item,)


@attrs.frozen
class _Settings:
    timeout: float = settings.setting(5.0, flag="--timeout", help="Seconds to wait")
    probe: bool = settings.setting(True, flag="--probe", help="Probe")
    count: int = settings.setting(3, flag="--count", short="-c", help="How many.")


class TestSettingOption:
    def _command(self, given: bool) -> click.Command:
        def run(**values: Any) -> None:
            click.echo(repr(sorted(values.items())))

        for field in reversed(attrs.fields(_Settings)):
            run = settings.option(field, field.default, field.name, given=given)(run)
        return click.command()(run)

    def test_help_shows_the_fields_default(self) -> None:
        """The option's help ends with the field's default, a switch as on/off and a float as %g."""
        helps = {p.name: p.help for p in self._command(given=False).params}
        assert helps == {
            "timeout": "Seconds to wait [default: 5].",
            "probe": "Probe [default: on].",
            "count": "How many. [default: 3].",
        }

    def test_not_given_is_none(self) -> None:
        """Unless given=True, an option not given is None (so a file's value stands); a bool gets --no-."""
        result = CliRunner().invoke(self._command(given=False), ["--no-probe", "-c", "4"])
        assert result.stdout.strip() == "[('count', 4), ('probe', False), ('timeout', None)]", result.output

    def test_given_takes_the_default(self) -> None:
        """With given=True the option's value defaults to the field's."""
        result = CliRunner().invoke(self._command(given=True), [])
        assert result.stdout.strip() == "[('count', 3), ('probe', True), ('timeout', 5.0)]"
