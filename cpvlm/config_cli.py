"""Command-line flags derived from config dataclasses: every option is declared once, as a field.

A field declared with ``arg(default, help=...)`` becomes the flag ``--field-name`` (``dest`` the
field's name) of ``add_fields(parser, Config)``, and ``from_args(Config, namespace)`` builds the
config back, field by field; the dataclass validates it (``__post_init__``), not the parser.

What the annotation gives (``typing.get_type_hints``; ``X | None`` is read as ``X``):

- ``bool``: ``--x/--no-x`` (``argparse.BooleanOptionalAction``);
- ``Literal[...]``: ``choices``; ``int``, ``float``, ``str``, ``Path``: ``type``;
- ``tuple[X, ...]``: ``nargs="*"`` of X (the values come back as a tuple); with ``sep=","`` in the
  metadata, one comma-separated word instead;
- a dataclass: its fields, flattened (the field's metadata ``group`` titles an argument group,
  as it does for one flag);
- ``Sub | None`` of a dataclass: its fields as ``--{prefix}-{field}`` flags, all unset by default
  (``prefix`` in the metadata, default the field name); unset all, the field is None, else
  ``Sub.from_flags(**values)`` (if Sub has it) or ``Sub(**the values set)``.

The default is the field's; a field without one is a required flag. The help is the metadata's
``help`` (a string, or a callable that returns one). ``flag`` in the metadata renames the flag;
``metavar``, ``nargs``, ``const``, ``choices``, ``type`` and ``action`` there are passed to
``add_argument`` as given (and then the annotation gives only what they leave out).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

PASSED = ("metavar", "nargs", "const", "choices", "type", "action")
"""Metadata keys handed to ``add_argument`` unchanged."""


def arg(
    default: Any = dataclasses.MISSING, *, help=None, default_factory=dataclasses.MISSING, **cli
):
    """A dataclass field with its flag's help (and any of ``flag``, ``sep``, ``group``,
    ``prefix`` and ``PASSED``)."""
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={"help": help, **cli}
    )


def like(cls, name: str, **changes):
    """The field ``name`` of ``cls`` declared again (its default and metadata), for a command
    that takes the same option: the declaration stays in ``cls``. ``changes``: metadata keys."""
    f = _field(cls, name)
    return dataclasses.field(
        default=f.default, default_factory=f.default_factory, metadata={**f.metadata, **changes}
    )


def help_of(cls, name: str) -> str:
    """The help of the field ``name`` of ``cls``."""
    text = _field(cls, name).metadata["help"]
    return text() if callable(text) else text


def _field(cls, name: str) -> dataclasses.Field:
    return {f.name: f for f in dataclasses.fields(cls)}[name]


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _optional(hint) -> tuple[Any, bool]:
    """``(X, True)`` for ``X | None``, else ``(hint, False)``."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(args) < len(typing.get_args(hint)):
            return args[0], True
    return hint, False


def _is_config(hint) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def field_default(f: dataclasses.Field) -> Any:
    """The field's default (``default_factory()`` called), or ``dataclasses.MISSING``."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _split(sep: str, kind):
    def parse(text: str) -> list:
        values = [kind(v) for v in text.split(sep) if v]
        if not values:
            raise argparse.ArgumentTypeError(f"expected a {sep!r}-separated list")
        return values

    return parse


def _scalar(hint) -> dict:
    """``type``/``choices`` of one value."""
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        return {"choices": choices, "type": type(choices[0])}
    if hint in (int, float, str, Path):
        return {"type": hint}
    return {}


def argument(f: dataclasses.Field, hint, *, unset: bool = False) -> dict:
    """The ``add_argument`` keywords of the field ``f`` (annotation ``hint``); ``unset``: the
    field of an optional sub-config, whose flags default to None."""
    meta = f.metadata
    hint, _ = _optional(hint)
    kw: dict[str, Any] = {k: meta[k] for k in PASSED if k in meta}
    default = None if unset else field_default(f)
    if typing.get_origin(hint) in (tuple, list):
        scalar = _scalar(_optional(typing.get_args(hint)[0])[0])
        if "sep" in meta:  # one word, split: the type makes the list (no choices of a list)
            kw.setdefault("type", _split(meta["sep"], scalar.get("type", str)))
            if default not in (None, dataclasses.MISSING):
                default = meta["sep"].join(str(v) for v in default)
        else:
            if "action" not in kw:
                kw.setdefault("nargs", "*")
            for k, v in scalar.items():
                kw.setdefault(k, v)
            if default not in (None, dataclasses.MISSING):
                default = list(default)  # what argparse's append and nargs give
    elif hint is bool and "action" not in kw and "nargs" not in kw:
        kw["action"] = argparse.BooleanOptionalAction
    else:
        for k, v in _scalar(hint).items():
            kw.setdefault(k, v)
    if default is dataclasses.MISSING:
        kw["required"] = True
    else:
        kw["default"] = default
    text = meta.get("help")
    kw["help"] = text() if callable(text) else text
    return kw


def flag_of(f: dataclasses.Field, prefix: str = "") -> str:
    return f.metadata.get("flag", "--" + (prefix + f.name).replace("_", "-"))


def _group(parser, title: str):
    """The argument group ``title`` of ``parser``, made once."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def add_fields(parser, cls, *, prefix: str = "", unset: bool = False) -> None:
    """A flag for every field of ``cls`` (sub-configs flattened) on ``parser``."""
    if not prefix:
        dests(cls)  # one dest per field
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        hint, optional = _optional(hints[f.name])
        if _is_config(hint):
            where = _group(parser, f.metadata["group"]) if "group" in f.metadata else parser
            if optional:
                sub_prefix = prefix + f.metadata.get("prefix", f.name) + "_"
                add_fields(where, hint, prefix=sub_prefix, unset=True)
            else:
                add_fields(where, hint, prefix=prefix, unset=unset)
            continue
        kw = argument(f, hints[f.name], unset=unset)
        flag = flag_of(f, prefix)
        if "flag" in f.metadata and "choices" not in kw and kw.get("nargs") != 0:
            kw.setdefault("metavar", flag[2:].upper().replace("-", "_"))  # the flag's, not dest's
        where = _group(parser, f.metadata["group"]) if "group" in f.metadata else parser
        action = where.add_argument(flag, dest=prefix + f.name, **kw)
        action.help = kw["help"]  # Python 3.10's BooleanOptionalAction appends its default


def _value(value, hint):
    """A parsed value as the field holds it: lists as tuples (nested too)."""
    hint, _ = _optional(hint)
    if isinstance(value, list) and typing.get_origin(hint) in (tuple, list):
        inner = typing.get_args(hint)[0]
        value = [_value(v, inner) for v in value]
        return tuple(value) if typing.get_origin(hint) is tuple else value
    if isinstance(value, list) and typing.get_origin(hint) is None:
        return tuple(value)
    return value


def field_values(cls, namespace, *, prefix: str = "") -> dict:
    """The keyword arguments of ``cls`` from the parsed ``namespace`` (see ``from_args``)."""
    hints = _hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint, optional = _optional(hints[f.name])
        if _is_config(hint) and optional:
            sub_prefix = prefix + f.metadata.get("prefix", f.name) + "_"
            values = {
                s.name: getattr(namespace, sub_prefix + s.name) for s in dataclasses.fields(hint)
            }
            hint_s = _hints(hint)
            values = {k: _value(v, hint_s[k]) for k, v in values.items()}
            if hasattr(hint, "from_flags"):
                out[f.name] = hint.from_flags(**values)
            elif all(v is None for v in values.values()):
                out[f.name] = None
            else:
                out[f.name] = hint(**{k: v for k, v in values.items() if v is not None})
        elif _is_config(hint):
            out[f.name] = from_args(hint, namespace, prefix=prefix)
        else:
            out[f.name] = _value(getattr(namespace, prefix + f.name), hints[f.name])
    return out


def from_args(cls, namespace, *, prefix: str = ""):
    """The config ``cls`` of the flags ``add_fields(parser, cls)`` parsed into ``namespace``."""
    return cls(**field_values(cls, namespace, prefix=prefix))


def dests(cls, *, prefix: str = "", unset: bool = False) -> dict[str, tuple]:
    """``{dest: (field, annotation, unset)}`` of every flag ``add_fields`` makes for ``cls``
    (``unset``: a field of an optional sub-config); two fields of one dest are refused."""
    hints = _hints(cls)
    out: dict[str, tuple] = {}
    for f in dataclasses.fields(cls):
        hint, optional = _optional(hints[f.name])
        if _is_config(hint):
            sub = prefix + f.metadata.get("prefix", f.name) + "_" if optional else prefix
            more = dests(hint, prefix=sub, unset=unset or optional)
        else:
            more = {prefix + f.name: (f, hints[f.name], unset)}
        for k, v in more.items():
            if k in out:
                raise ValueError(f"{cls.__name__}: two fields make the flag dest {k!r}")
            out[k] = v
    return out
