"""One declaration per setting: a service's settings dataclass reads and writes its own command line.

Each field of a service's settings dataclass is declared once with ``setting(...)``: default, help, flag
(and aliases), the TGI environment variable, choices, bounds (``ge``/``gt``/``le``/``lt``) and any other
rule on the value alone (``check``). From that one declaration come the service's argparse parser
(``parse``), the argv that starts the service with these settings (``to_argv``), the check of every value
(``problem``, worded as TGI's launcher words it), and the click options of ``llmbus up``
(``click_options``), which composes every service's user-facing settings and hands each service its own
(``supervisor/plan.py``). Adding a setting is adding one field. Rules across fields are the class's own
``validate()``; a settings object that breaks either kind of rule is never built (``SettingsError``).

Booleans come in two shapes, as TGI's launcher has them: off by default, a bare switch
(``--enable-prefill-logprobs``); on by default, a value (``--prefix-caching false``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass

_KEY = "llmbus.setting"
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_bool(value: str) -> bool:
    lowered = str(value).strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"not a boolean: {value!r}")


@dataclass(frozen=True)
class Spec:
    help: str
    flag: str | None  # None: --field-name
    aliases: tuple[str, ...]
    env: str | None  # read when the flag is not given (TGI's variable names)
    choices: tuple | None
    user: bool  # a flag of `llmbus up` (False: set by the launcher itself, e.g. the run dir)
    secret: bool  # travels in the environment, never on a command line (every user can read those)
    hidden: bool
    ge: float | None = None  # bounds of the value (None, an unset optional setting, is not checked)
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    check: Callable[[object], str | None] | None = None  # what is wrong with a value ("must be ..."), or None


def setting(default=MISSING, *, help: str, flag: str | None = None, aliases: tuple[str, ...] = (),
            env: str | None = None, choices: tuple | None = None, user: bool = True, secret: bool = False,
            hidden: bool = False, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None, check: Callable[[object], str | None] | None = None,
            default_factory=MISSING):
    spec = Spec(help, flag, tuple(aliases), env, choices, user, secret, hidden, ge, gt, le, lt, check)
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={_KEY: spec})
    return dataclasses.field(default=default, metadata={_KEY: spec})


def offered(service, name: str):
    """``service``'s own setting ``name`` (declared there with ``user=False``, set by the launch), as a flag
    of the launch itself: the same declaration (help, variable, bounds), listed where this field is."""
    d = declared_setting(service, name)
    spec = dataclasses.replace(d.spec, user=True, hidden=False)
    return dataclasses.field(default=d.default, metadata={_KEY: spec})


class SettingsError(ValueError):
    """Settings that break a declared bound or a class's ``validate()`` rule: TGI's one line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("Invalid argument: " + "; ".join(problems))


@dataclass(frozen=True)
class Declared:
    """A field as the command lines see it."""

    name: str
    kind: type  # int, float, str, bool or list (of str)
    optional: bool
    default: object
    spec: Spec

    @property
    def flag(self) -> str:
        return self.spec.flag or "--" + self.name.replace("_", "-")

    @property
    def switch(self) -> bool:
        return self.kind is bool and self.default is False

    @property
    def arg_name(self) -> str:
        """The name messages give it: its flag's, as TGI's launcher names an argument."""
        return self.flag.lstrip("-").replace("-", "_")

    def convert(self, raw: str):
        return parse_bool(raw) if self.kind is bool else self.kind(raw)

    def problem(self, value) -> str | None:
        """What is wrong with ``value`` by this setting's bounds and check, in TGI's words; None if nothing."""
        if value is None:
            return None
        s, name = self.spec, f"`{self.arg_name}`"
        if s.check is not None:
            complaint = s.check(value)
            if complaint is not None:
                return f"{name} {complaint}"
        low_ok = (s.ge is None or value >= s.ge) and (s.gt is None or value > s.gt)
        high_ok = (s.le is None or value <= s.le) and (s.lt is None or value < s.lt)
        if low_ok and high_ok:
            return None
        if s.ge == 1 and self.kind is int and s.le is None and s.lt is None:
            return f"{name} must be > 0"  # a count: TGI says so without the value
        if s.ge is not None and s.le is not None:
            return f"{name} must be between {s.ge} and {s.le}. Given: {value}"
        if s.gt is not None and s.le is not None:
            return f"{name} must be in ({s.gt}, {s.le}]. Given: {value}"
        if s.gt is not None and s.lt is not None:
            return f"{name} must be > {s.gt} and < {s.lt}. Given: {value}"
        low = f">= {s.ge}" if s.ge is not None else f"> {s.gt}" if s.gt is not None else None
        high = f"<= {s.le}" if s.le is not None else f"< {s.lt}" if s.lt is not None else None
        return f"{name} must be {' and '.join(b for b in (low, high) if b)}. Given: {value}"


def declared(cls) -> list[Declared]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KEY)
        if spec is None:
            continue
        kind, optional = _unwrap(hints[f.name])
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)
        out.append(Declared(f.name, kind, optional, default, spec))
    return out


def declared_setting(cls, name: str) -> Declared:
    """The field ``name`` of settings class ``cls``, as the command lines see it."""
    return next(d for d in declared(cls) if d.name == name)


def _unwrap(hint) -> tuple[type, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _unwrap(inner[0])[0], True
    if typing.get_origin(hint) in (list, tuple):
        return list, False
    return hint, False


def problems(settings: list[Declared], values: dict) -> list[str]:
    """Every declared bound or check that ``values`` (by name) break, in the order of ``settings``."""
    found = (d.problem(values.get(d.name)) for d in settings)
    return [p for p in found if p is not None]


def a_folder(value: str) -> str | None:
    """A ``check`` for a folder argument given by a command substitution that may have failed (the Procfile's
    ``$(llmbus model-dir ...)``)."""
    return None if value.strip() else "must name a folder, not an empty string (a `llmbus model-dir` before it failed?)"


def finite(value: float) -> str | None:
    """A ``check`` for floats that nan and infinities would break."""
    return None if math.isfinite(value) else f"must be a finite number. Given: {value}"


def parsed_values(parser: argparse.ArgumentParser, argv: list[str] | None) -> dict:
    """``parser``'s values for ``argv`` (a ``ServiceSettings.parser``'s, perhaps with flags of its own); a
    flag left to an environment variable that does not convert exits 2 with argparse's one line."""
    values = vars(parser.parse_args(argv))
    bad = next((v for v in values.values() if isinstance(v, _BadVariable)), None)
    if bad is not None:
        parser.error(bad.why)
    return values


@dataclass(frozen=True)
class _BadVariable:
    """A flag's default from an environment variable that does not convert: an error if the flag is not given."""

    why: str


class ServiceSettings:
    """Mixin for a settings dataclass whose fields are declared with ``setting``: built only from values
    that keep every declared bound and the class's ``validate()``."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``SettingsError`` with what breaks a declared bound, then what breaks ``validate()``."""
        fields = declared(type(self))
        found = problems(fields, {d.name: getattr(self, d.name) for d in fields}) or self.validate()
        if found:
            raise SettingsError(found)

    def validate(self) -> list[str]:
        """Rules across fields, each broken one in TGI's words (a class with such rules overrides this)."""
        return []

    @classmethod
    def parser(cls, prog: str, description: str | None = None) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=prog, description=description)
        for d in declared(cls):
            env_value = (os.environ.get(d.spec.env) or None) if d.spec.env else None
            names = [d.flag, *d.spec.aliases]
            common = dict(dest=d.name, help=d.spec.help if not d.spec.hidden else argparse.SUPPRESS)
            if env_value:
                try:
                    env_value = d.convert(env_value) if d.kind is not list else env_value
                except ValueError:  # refused only where the flag is not given: it wins over the variable
                    env_value = _BadVariable(f"{d.spec.env}={env_value!r} is not a valid value for {d.flag}")
            if d.switch:
                p.add_argument(*names, action="store_true", default=env_value or False, **common)
            elif d.kind is list:
                p.add_argument(*names, action="append", default=None, **common)
            else:
                default = env_value if env_value is not None else (None if d.default is MISSING else d.default)
                p.add_argument(*names, type=d.convert, default=default, choices=d.spec.choices,
                               required=d.default is MISSING and env_value is None,
                               metavar="true|false" if d.kind is bool else d.flag.lstrip("-").upper().replace("-", "_"),
                               **common)
        return p

    @classmethod
    def parse(cls, argv: list[str] | None, prog: str, description: str | None = None):
        """(settings, the parser) from a command line; a bad flag exits 2 with argparse's message."""
        p = cls.parser(prog, description)
        values = parsed_values(p, argv)
        for d in declared(cls):
            if d.kind is list and values[d.name] is None:
                values[d.name] = list(d.default) if d.default is not MISSING else []
        try:
            return cls(**values), p
        except ValueError as e:  # SettingsError: TGI's line, as argparse's own errors (exit 2)
            p.error(str(e))

    def to_argv(self) -> list[str]:
        """The flags that give a service exactly these settings (secrets excluded: see ``secret_env``)."""
        argv: list[str] = []
        for d in declared(type(self)):
            value = getattr(self, d.name)
            if d.spec.secret or value is None:
                continue
            if d.switch:
                argv += [d.flag] if value else []
            elif d.kind is list:
                for item in value:
                    argv += [d.flag, str(item)]
            else:
                argv += [d.flag, str(value).lower() if d.kind is bool else str(value)]
        return argv

    def secret_env(self) -> dict[str, str]:
        """The secret settings as the environment variables the service reads them from."""
        return {d.spec.env: str(getattr(self, d.name)) for d in declared(type(self))
                if d.spec.secret and getattr(self, d.name) is not None}

    @classmethod
    def user_settings(cls) -> list[Declared]:
        return [d for d in declared(cls) if d.spec.user]


def click_options(settings: list[Declared]):
    """click options for ``settings`` (deduplicated by name; the first declaration of a name wins)."""
    import click

    seen, options = set(), []
    for d in settings:
        if d.name in seen:
            continue
        seen.add(d.name)
        names = [d.flag, *d.spec.aliases, d.name]
        common = dict(envvar=d.spec.env, help=d.spec.help, hidden=d.spec.hidden)
        if d.switch:
            options.append(click.Option(names, is_flag=True, default=False, **common))
        elif d.kind is list:
            options.append(click.Option(names, multiple=True, **common))
        else:
            kind = {bool: click.BOOL, int: int, float: float}.get(d.kind, str)
            if d.spec.choices:
                kind = click.Choice(list(d.spec.choices))
            default = None if d.default is MISSING else d.default
            options.append(click.Option(names, type=kind, default=default,
                                        show_default=default is not None and not d.spec.secret, **common))
    return options
