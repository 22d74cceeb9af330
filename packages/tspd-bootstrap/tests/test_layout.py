"""The KV server's one canonical layout form: tspd_core's strict contract parser, by name."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tspd_bootstrap import DEFAULT_CANONICALIZER, default_canonicalizer, load_canonicalizer

canonical = default_canonicalizer()


def test_the_default_is_tspd_cores_contract_form() -> None:
    assert DEFAULT_CANONICALIZER == "tspd_core.layout:canonical_layout_text"
    from tspd_core.layout import canonical_layout_text

    assert canonical is canonical_layout_text


def test_the_wire_example_is_its_own_canonical_form(layout: str) -> None:
    assert len(layout) == 1703
    assert canonical(layout) == layout


def test_pretty_printed_layouts_canonicalise_to_the_same_bytes(layout: str) -> None:
    pretty = json.dumps(json.loads(layout), indent=4)
    assert pretty != layout
    assert canonical(pretty) == layout


def test_group_spec_keys_with_defaults_may_be_left_out(layout: str) -> None:
    """TokenSpeed's parser fills them in, so such a layout is the same layout (its server
    answers 200 to a second rank sending it): the canonical form is the full one."""
    obj = json.loads(layout)
    spec = obj["group_specs"][0]
    for key in ("sliding_window_tokens", "family", "checkpoint_granularity"):
        del spec[key]  # null, "history", null: the defaults
    sparse = json.dumps(obj)
    assert canonical(sparse) == layout


def _edited(layout: str, edit: Any) -> str:
    obj = json.loads(layout)
    edit(obj)
    return json.dumps(obj)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # TokenSpeed's server refuses each of these (its contract dataclasses do).
        (lambda o: o["plan"]["fields"][0].update(color=1), "unknown key"),
        (lambda o: o["plan"]["planes"][0].pop("arena_offset_bytes"), "missing key"),
        (lambda o: o["plan"]["fields"][0].update(dtype="float4"), "unknown dtype 'float4'"),
        (lambda o: o["group_specs"][0].update(rows_per_page=None), "declare rows_per_page"),
        (
            lambda o: o["transfer_schema"]["fields"][0]["partition"].update(global_extent=3),
            "must be a multiple of the local extent 2",
        ),
        (
            lambda o: o["transfer_schema"]["fields"].append(
                {
                    "field_id": "layer.7.k",
                    "partition": {"axis": 1, "global_extent": 4, "global_parts": []},
                }
            ),
            "'layer.7.k' is not a field of the plan",
        ),
    ],
)
def test_layouts_tokenspeed_refuses_are_refused(layout: str, edit: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        canonical(_edited(layout, edit))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "contract: not valid JSON"),
        ("[]", "contract: must be a JSON object, got list"),
        ('{"plan":{}}', "plan: missing key 'prefix_granularity'"),
        ('{"plan":{"x":NaN}}', "plan: missing key"),
        ('{"plan":"é"}', "contract: must be ASCII JSON"),
    ],
)
def test_refusals_say_why(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        canonical(text)


def test_loading_a_canonicalizer_by_name() -> None:
    assert load_canonicalizer("json:dumps") is json.dumps
    with pytest.raises(ValueError, match=r"'jsondumps': expected MODULE:FUNCTION"):
        load_canonicalizer("jsondumps")
    with pytest.raises(ValueError, match=r"cannot import 'no_such_mod_xyz'.*install tspd-core"):
        load_canonicalizer("no_such_mod_xyz:f")
    with pytest.raises(ValueError, match=r"json has no callable 'nope'"):
        load_canonicalizer("json:nope")
