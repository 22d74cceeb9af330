"""The engine settings' flags of ``tspd-sim``: the engine's words, a role's own flag over the
flag for both roles, and the old spellings still accepted with a one-line deprecation note."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from tspd_sim.cli import main
from tspd_sim.cli_args import add_cluster_options, build_config, merge_variant
from tspd_sim.cluster import EngineTuning

BASE = EngineTuning()


def _parser(defaults: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tspd-sim run")
    add_cluster_options(parser, defaults=defaults)
    return parser


def _tuning(argv: list[str]) -> EngineTuning:
    return build_config(_parser().parse_args(argv)).cluster.tuning


@pytest.mark.parametrize(
    ("argv", "changes"),
    [
        ([], {}),
        (["--max-prefill-tokens", "512"], {"max_prefill_tokens": 512}),
        (["--max-running", "8"], {"prefill_max_running": 8, "decode_max_running": 8}),
        (["--prefill-max-running", "3"], {"prefill_max_running": 3}),
        (["--decode-max-running", "5"], {"decode_max_running": 5}),
        # A role's own flag wins over the flag for both, in either order.
        (["--max-running", "8", "--decode-max-running", "5"], {"prefill_max_running": 8,
                                                              "decode_max_running": 5}),
        (["--prefill-max-running", "3", "--max-running", "8"], {"prefill_max_running": 3,
                                                               "decode_max_running": 8}),
        (["--no-prefix-cache"], {"prefill_prefix_cache": False, "decode_prefix_cache": False}),
        (["--no-prefill-prefix-cache"], {"prefill_prefix_cache": False}),
        (["--no-decode-prefix-cache"], {"decode_prefix_cache": False}),
        (["--no-decode-rounds"], {"decode_rounds": False}),
        (["--decode-rounds"], {}),
        (["--hold-first-token"], {"early_first_token": False}),
        (["--no-hold-first-token"], {}),
        (["--page-layout", "hnd", "--arrangement", "page_major"],
         {"page_layout": "hnd", "arrangement": "page_major"}),
    ],
)  # fmt: skip
def test_each_flag_sets_its_setting(argv: list[str], changes: dict[str, object]) -> None:
    assert _tuning(argv) == replace(BASE, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("old", "new", "note"),
    [
        (["--chunk-tokens", "512"], ["--max-prefill-tokens", "512"], "use --max-prefill-tokens"),
        (["--prefill-capacity", "3"], ["--prefill-max-running", "3"],
         "use --prefill-max-running"),
        (["--decode-capacity", "5"], ["--decode-max-running", "5"], "use --decode-max-running"),
        (["--first-token-from-prefill"], ["--no-hold-first-token"],
         "it is the default now (--hold-first-token turns it off)"),
    ],
)  # fmt: skip
def test_an_old_spelling_still_works_and_says_so_once(
    old: list[str], new: list[str], note: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _tuning(old) == _tuning(new)
    assert capsys.readouterr().err == f"tspd-sim run: {old[0]} is deprecated; {note}\n"
    # The old spelling overrides what came before it, as the new one does.
    assert _tuning(["--hold-first-token", *old]) == _tuning(["--hold-first-token", *new])


def test_old_spellings_are_kept_out_of_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    for flag in ("--max-prefill-tokens", "--max-running", "--prefill-max-running",
                 "--decode-max-running", "--no-prefix-cache", "--hold-first-token",
                 "--no-decode-rounds"):  # fmt: skip
        assert flag in text, flag
    for old in ("--chunk-tokens", "--prefill-capacity", "--decode-capacity",
                "--first-token-from-prefill"):  # fmt: skip
        assert old not in text, old


def test_a_variant_changes_only_what_it_names() -> None:
    base = _parser().parse_args(["--prefill-max-running", "16", "--hold-first-token"])
    over = _parser(defaults=False).parse_args(["--max-running", "32", "--no-hold-first-token"])
    tuning = build_config(merge_variant(base, over)).cluster.tuning
    assert tuning == replace(BASE, prefill_max_running=16, decode_max_running=32)
    rounds = _parser(defaults=False).parse_args(["--no-decode-rounds"])
    assert build_config(merge_variant(base, rounds)).cluster.tuning == replace(
        BASE, prefill_max_running=16, early_first_token=False, decode_rounds=False
    )
