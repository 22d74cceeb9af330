"""The default layout canonicaliser: WIRE §4's serializer applied to the envelope."""

from __future__ import annotations

import json
import re

import pytest

from tspd_bootstrap import canonical_layout


def test_the_wire_example_is_its_own_canonical_form(layout: str) -> None:
    assert len(layout) == 1703
    assert canonical_layout(layout) == layout


def test_pretty_printed_layouts_canonicalise_to_the_same_bytes(layout: str) -> None:
    pretty = json.dumps(json.loads(layout), indent=4)
    assert pretty != layout
    assert canonical_layout(pretty) == layout


def test_key_order_is_kept_not_sorted() -> None:
    text = '{"transfer_schema":{"z":1,"a":2},"group_specs":[{"b":1,"a":2}],"plan":{"y":0,"x":1}}'
    assert canonical_layout(text) == (
        '{"plan":{"y":0,"x":1},"group_specs":[{"b":1,"a":2}],"transfer_schema":{"z":1,"a":2}}'
    )


def test_unknown_top_level_keys_are_dropped_and_output_is_ascii() -> None:
    text = '{"plan":{"n":"é"},"group_specs":[],"transfer_schema":{},"version":3}'
    assert (
        canonical_layout(text) == '{"plan":{"n":"\\u00e9"},"group_specs":[],"transfer_schema":{}}'
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "cache_layout is not valid JSON: Expecting property name"),
        ("[]", "cache_layout must be a JSON object, got list"),
        ('{"plan":{}}', "cache_layout lacks top-level key(s): group_specs, transfer_schema"),
        (
            '{"plan":[],"group_specs":[],"transfer_schema":{}}',
            "cache_layout 'plan' must be a JSON object",
        ),
        (
            '{"plan":{},"group_specs":{},"transfer_schema":{}}',
            "cache_layout 'group_specs' must be a JSON array",
        ),
        (
            '{"plan":{"x":NaN},"group_specs":[],"transfer_schema":{}}',
            "cache_layout is not valid JSON: NaN",
        ),
        ('{"plan":' + "[" * 100_000, "cache_layout nests too deeply"),
    ],
)
def test_refusals_say_why(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        canonical_layout(text)
