"""Settings declared once: an attrs field whose metadata says how a command and a file spell it.

A command's setting is one attrs field made with `setting`: its default, type and validator are
the field's, and its `Setting` metadata holds what the field cannot: the command-line flag, the
help line, the file's table. `option` turns such a field into its click option, so the flag, its
type and the default its help shows all come from the field (``kvroute serve`` and ``kvroute
simulate`` build their options this way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import click

from kvroute.validators import Validator

__all__ = ["Setting", "option", "setting", "shown_default"]


@attrs.frozen
class Setting:
    """What a command knows of one setting besides its attrs field: its flag, help and file table.

    ``flag=None``: the setting is read from a file only. ``section`` names the file's table when
    the field's class does not imply it. ``short`` is a one-letter alias (``-n``); ``click_type`` a
    click type narrower than the field's own (``click.IntRange(1, 4096)``).
    """

    help: str
    flag: str | None = None
    section: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    #: Whether the help shows the default (``on``/``off`` for a switch).
    show_default: bool = True
    envvar: str | None = None
    short: str | None = None
    click_type: Any = None


def setting(
    default: Any = attrs.NOTHING,
    validator: Validator | None = None,
    *,
    help: str,
    flag: str | None = None,
    section: str | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    show_default: bool = True,
    envvar: str | None = None,
    short: str | None = None,
    click_type: Any = None,
    factory: Any = None,
    repr: bool = True,
    converter: Any = None,
) -> Any:
    """An attrs field that is a setting (see `Setting`)."""
    meta = {"setting": Setting(help, flag, section, metavar, choices, show_default, envvar, short, click_type)}
    if factory is not None:
        return attrs.field(factory=factory, validator=validator, repr=repr, converter=converter, metadata=meta)
    return attrs.field(default=default, validator=validator, repr=repr, converter=converter, metadata=meta)


def shown_default(default: Any) -> str:
    """A default as a help line shows it: ``on``/``off`` for a switch, ``5`` for 5.0 seconds."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


#: Click types by field type, as a class or as the string an unresolved annotation leaves.
_CLICK_TYPES: dict[Any, type] = {int: int, float: float, "int": int, "float": float}


def option(
    field: attrs.Attribute[Any], default: Any, name: str, *, given: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The click option of a `setting` field: its flag (``--x/--no-x`` for a bool), type, metavar and help.

    ``default`` is the field's default (a nested field's is its class's). With ``given=False`` the
    option's value is ``None`` unless the flag is given, so a file's value stands, and the help ends
    with ``[default: ...].``; with ``given=True`` the option takes the default itself and click shows it.
    """
    meta: Setting = field.metadata["setting"]
    if meta.flag is None:
        raise ValueError(f"{field.name!r} has no flag")
    switch = field.type in (bool, "bool")
    decls = [f"{meta.flag}/--no-{meta.flag[2:]}" if switch else meta.flag, name]
    if meta.short:
        decls.insert(0, meta.short)
    kind = meta.click_type
    if kind is None:
        kind = click.Choice(list(meta.choices)) if meta.choices else _CLICK_TYPES.get(field.type)
    if given:
        return click.option(
            *decls, type=kind, default=default, show_default=meta.show_default, metavar=meta.metavar, help=meta.help
        )
    help_text = f"{meta.help} [default: {shown_default(default)}]." if meta.show_default else f"{meta.help}."
    return click.option(*decls, type=kind, default=None, metavar=meta.metavar, envvar=meta.envvar, help=help_text)
