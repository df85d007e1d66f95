"""Lock-name templates: parsing, resolution and rendering (pure; no Redis involved)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from django_redlock.core.keys import MAX_NAME_LENGTH, InvalidLockName
from django_redlock.core.templates import (
    Placeholder,
    TemplateError,
    UnresolvedPlaceholder,
    format_value,
    parse_template,
    resolve_path,
)


def test_parse_literal_and_placeholders() -> None:
    t = parse_template("order:<order.customer_id>:<pk>")
    assert t.parts == ("order:", Placeholder("order.customer_id"), ":", Placeholder("pk"))
    assert [str(p) for p in t.placeholders] == ["<order.customer_id>", "<pk>"]
    assert t.roots == frozenset({"order", "pk"})
    p = t.placeholders[0]
    assert (p.root, p.attrs, p.path) == ("order", ("customer_id",), ("order", "customer_id"))


def test_constant_template_is_validated_now() -> None:
    assert parse_template("nightly-report").render(lambda p: 1 / 0) == "nightly-report"
    with pytest.raises(TemplateError, match="whitespace"):
        parse_template(" padded ")


@pytest.mark.parametrize("source, message", [
    ("", "must not be empty"),
    ("stock:<pk", r"unbalanced '<' at position 6"),
    ("stock:pk>", r"unbalanced '>' at position 8"),
    ("a<b<c>", r"unbalanced '<' at position 1"),
    ("stock:<>", r"empty placeholder '<>' at position 6"),
    ("stock:<a..b>", r"bad placeholder <a..b>.*got ''"),
    ("stock:<1pk>", r"bad placeholder <1pk>.*got '1pk'"),
    ("stock:<p k>", r"bad placeholder <p k>"),
    ("stock:<pk.>", r"bad placeholder <pk.>"),
    ("line\nbreak:<pk>", "control character"),
    ("x" * (MAX_NAME_LENGTH + 1) + "<pk>", "longer than a lock name may be"),
])
def test_parse_errors_say_what_and_where(source: str, message: str) -> None:
    with pytest.raises(TemplateError, match=message):
        parse_template(source)


def test_non_string_template() -> None:
    with pytest.raises(TemplateError, match="must be a str, not int"):
        parse_template(42)


def test_render_from_mapping_and_attributes() -> None:
    order = SimpleNamespace(customer=SimpleNamespace(pk=7))
    t = parse_template("order:<order.customer.pk>:<day>")
    assert t.render_from({"order": order, "day": "2024-05-01"}) == "order:7:2024-05-01"


def test_resolve_path_reads_mapping_keys_then_attributes() -> None:
    p = Placeholder("payload.order.id")
    assert resolve_path({"order": {"id": 3}}, p) == 3
    assert resolve_path(SimpleNamespace(order={"id": 4}), p) == 4


def test_unresolved_names_the_placeholder_and_the_missing_step() -> None:
    t = parse_template("order:<order.customer.pk>")
    with pytest.raises(UnresolvedPlaceholder) as info:
        t.render_from({"order": SimpleNamespace(customer=object())})
    assert info.value.placeholder == Placeholder("order.customer.pk")
    assert "<order.customer.pk>" in str(info.value)
    assert "order.customer (object) has no attribute or key 'pk'" in str(info.value)
    with pytest.raises(UnresolvedPlaceholder, match="no value named 'day'"):
        parse_template("r:<day>").render_from({})


@pytest.mark.parametrize("value, message", [
    (None, "resolved to None"),
    ("", "resolved to an empty string"),
    (b"abc", "resolved to bytes"),
    ("a\x00b", "control character"),
    ("a\nb", "control character"),
    (print, "resolved to a callable"),
])
def test_unsafe_values_are_rejected_not_mangled(value: object, message: str) -> None:
    t = parse_template("stock:<pk>")
    with pytest.raises(InvalidLockName, match=message) as info:
        t.render_from({"pk": value})
    assert "<pk>" in str(info.value) and "stock:<pk>" in str(info.value)


def test_rendered_name_over_the_limit_is_rejected() -> None:
    t = parse_template("stock:<pk>")
    assert t.render_from({"pk": "x" * (MAX_NAME_LENGTH - 6)}) == "stock:" + "x" * 194
    with pytest.raises(InvalidLockName, match=f"limit is {MAX_NAME_LENGTH}") as info:
        t.render_from({"pk": "x" * MAX_NAME_LENGTH})
    assert "template 'stock:<pk>'" in str(info.value)


def test_rendered_name_with_outer_whitespace_is_rejected() -> None:
    with pytest.raises(InvalidLockName, match="whitespace"):
        parse_template("<name>").render_from({"name": " padded"})


def test_format_value_keeps_ordinary_values() -> None:
    p = Placeholder("v")
    assert format_value(p, 42) == "42"
    assert format_value(p, "a:b") == "a:b"
    assert format_value(p, 0) == "0"  # falsy but a real value
    assert format_value(p, False) == "False"
