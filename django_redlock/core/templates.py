"""Lock-name templates: ``"stock:<pk>"``, ``"order:<order.customer_id>"``.

Pure: parsing, attribute resolution and rendering, without Django or I/O, so the
rules are unit tested on their own. The Django layer (``with_lock``, the ORM
helpers) decides *where* a placeholder's root comes from (URL kwargs, the
request, ``self``, bound arguments); this module does the rest the same way for
all of them.

Why names are rejected rather than repaired: a template that renders ``"stock:"``
(empty value) or ``"stock:None"`` (an unsaved object, an anonymous user) would
make unrelated requests share one lock, or a lock that protects nothing. The
rendered name must pass :func:`~django_redlock.core.keys.validate_name`, and a
placeholder whose value is ``None``, empty, a callable or bytes is an error that
names the placeholder and the template.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .keys import MAX_NAME_LENGTH, InvalidLockName, validate_name

__all__ = [
    "LockNameTemplate",
    "Placeholder",
    "TemplateError",
    "UnresolvedPlaceholder",
    "format_value",
    "parse_template",
    "resolve_path",
]

_PLACEHOLDER = re.compile(r"<([^<>]*)>")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class TemplateError(ValueError):
    """A template that cannot be parsed (unbalanced ``<``/``>``, a bad placeholder)."""


class UnresolvedPlaceholder(LookupError):
    """A placeholder whose value could not be found; ``placeholder`` says which."""

    def __init__(self, placeholder: Placeholder, reason: str) -> None:
        super().__init__(f"cannot resolve placeholder {placeholder}: {reason}")
        self.placeholder = placeholder
        self.reason = reason


@dataclass(frozen=True)
class Placeholder:
    """One ``<root.attr.attr>`` placeholder."""

    text: str  #: what is between the angle brackets, e.g. ``"request.user.pk"``

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.text.split("."))

    @property
    def root(self) -> str:
        """The first name: looked up in the caller's sources (kwargs, arguments, ...)."""
        return self.path[0]

    @property
    def attrs(self) -> tuple[str, ...]:
        """The dotted rest, followed with ``getattr`` (or ``[key]`` on a mapping)."""
        return self.path[1:]

    def __str__(self) -> str:
        return f"<{self.text}>"


@dataclass(frozen=True)
class LockNameTemplate:
    """A parsed template: literal text and placeholders, in order."""

    source: str
    parts: tuple[str | Placeholder, ...]

    @property
    def placeholders(self) -> tuple[Placeholder, ...]:
        return tuple(p for p in self.parts if isinstance(p, Placeholder))

    @property
    def roots(self) -> frozenset[str]:
        return frozenset(p.root for p in self.placeholders)

    def render(self, lookup: Callable[[Placeholder], Any]) -> str:
        """The lock name, with each placeholder's value from ``lookup(placeholder)``.

        ``lookup`` raises :class:`UnresolvedPlaceholder` for a value it cannot
        find; that propagates. A value that cannot be part of a lock name, or a
        rendered name that :func:`validate_name` refuses, raises
        :class:`~django_redlock.core.keys.InvalidLockName` naming the template.
        """
        out: list[str] = []
        for part in self.parts:
            if isinstance(part, Placeholder):
                value = lookup(part)
                try:
                    out.append(format_value(part, value, self.source))
                except InvalidLockName as e:
                    e.placeholder = part
                    raise
            else:
                out.append(part)
        last = self.parts[-1] if self.parts else None
        if isinstance(last, Placeholder) and _FAMILY_TAIL.search(out[-1]):
            # "doc:<request.GET.doc>" with ?doc=5#line is "doc:5#line", the
            # waiting line of semaphore("doc:5"): a client held it, and the
            # semaphore refused every acquirer with all its permits free.
            refused = InvalidLockName(
                f"placeholder {last} of template {self.source!r} resolved to {out[-1]!r}, "
                f"which ends like a semaphore's or segments' own lock (NAME#<i>, NAME#line, "
                f"NAME#free, NAME[<i>], NAME[free]): the name would lock a member of "
                f"another lock's family")
            refused.placeholder = last
            raise refused
        name = "".join(out)
        try:
            return validate_name(name)
        except InvalidLockName as e:
            raise InvalidLockName(f"template {self.source!r} rendered an unusable lock name: "
                                  f"{e}") from None

    def render_from(self, values: Mapping[str, Any]) -> str:
        """Render with roots looked up in ``values`` (then attributes followed)."""

        def lookup(p: Placeholder) -> Any:
            if p.root not in values:
                raise UnresolvedPlaceholder(p, f"no value named {p.root!r}")
            return resolve_path(values[p.root], p)

        return self.render(lookup)


def parse_template(source: object) -> LockNameTemplate:
    """Parse ``source``; raise :class:`TemplateError` saying what is wrong and where.

    A placeholder is ``<name>`` or dotted ``<name.attr.attr>``, each part a Python
    identifier. Literal text may not contain ``<``, ``>`` or control characters.
    A template without placeholders is a constant lock name and is validated now.
    """
    if not isinstance(source, str):
        raise TemplateError(f"a lock name template must be a str, not {type(source).__name__}")
    if not source:
        raise TemplateError("a lock name template must not be empty")
    parts: list[str | Placeholder] = []
    pos = 0
    for match in _PLACEHOLDER.finditer(source):
        literal = source[pos:match.start()]
        _check_literal(source, literal, pos)
        if literal:
            parts.append(literal)
        text = match.group(1)
        if not text:
            raise TemplateError(f"empty placeholder '<>' at position {match.start()} in "
                                f"template {source!r}")
        for segment in text.split("."):
            if not _IDENTIFIER.match(segment):
                raise TemplateError(
                    f"bad placeholder <{text}> in template {source!r}: each dotted part must be "
                    f"a Python identifier, got {segment!r}")
        parts.append(Placeholder(text))
        pos = match.end()
    tail = source[pos:]
    _check_literal(source, tail, pos)
    if tail:
        parts.append(tail)
    literal_length = sum(len(p) for p in parts if isinstance(p, str))
    if literal_length > MAX_NAME_LENGTH:
        raise TemplateError(f"template {source!r} is longer than a lock name may be "
                            f"({MAX_NAME_LENGTH} characters) before any placeholder is filled")
    template = LockNameTemplate(source, tuple(parts))
    if not template.placeholders:
        try:
            validate_name(source)
        except InvalidLockName as e:
            raise TemplateError(f"template {source!r} is not a usable lock name: {e}") from None
    return template


def _check_literal(source: str, literal: str, offset: int) -> None:
    for ch in "<>":
        index = literal.find(ch)
        if index >= 0:
            raise TemplateError(f"unbalanced {ch!r} at position {offset + index} in template "
                                f"{source!r}; placeholders look like <name> or <obj.attr>")
    if _CONTROL.search(literal):
        raise TemplateError(f"template {source!r} contains a control character")


def resolve_path(obj: Any, placeholder: Placeholder) -> Any:
    """Follow ``placeholder.attrs`` from ``obj`` (the root's value).

    Each step is an attribute, or a key when the object is a mapping and has it
    (so ``<request.GET.day>`` and ``<payload.order_id>`` on a dict both work).
    """
    walked = placeholder.root
    for attr in placeholder.attrs:
        if isinstance(obj, Mapping) and attr in obj:
            obj = obj[attr]
        else:
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                raise UnresolvedPlaceholder(
                    placeholder, f"{walked} ({type(obj).__name__}) has no attribute or key "
                                 f"{attr!r}") from None
        walked += "." + attr
    return obj


#: How the lock names of a lock family's members end (core/keys.py): a
#: semaphore's permits, line and free channel, segments and their channel.
_FAMILY_TAIL = re.compile(r"(?:#(?:\d+|line|free)|\[(?:\d+|free)\])\Z")


def format_value(placeholder: Placeholder, value: Any, source: str = "") -> str:
    """The text a placeholder's value contributes to the name; refuses unsafe values."""
    where = f"placeholder {placeholder}" + (f" of template {source!r}" if source else "")
    if value is None:
        raise InvalidLockName(
            f"{where} resolved to None; a lock name needs a real value (an unsaved object? "
            f"an anonymous user?)")
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidLockName(f"{where} resolved to bytes; decode it or use a str/int attribute")
    if callable(value):
        raise InvalidLockName(f"{where} resolved to a callable ({value!r}); name an attribute "
                              f"that holds a value, not a method")
    text = str(value)
    if not text:
        raise InvalidLockName(f"{where} resolved to an empty string")
    if _CONTROL.search(text):
        raise InvalidLockName(f"{where} resolved to a value with a control character: {text!r}")
    return text
