"""The router's text parts on real tokenizers: incremental detokenization (any chunking joins
to the one-shot decode, no piece holds half a character), chat templates in the sandbox, and
what a request carries (extra EOS ids, return_token_ids)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers

from tspd_engine.errors import ConfigError, TemplateError
from tspd_engine.model.chat_template import ChatTemplate
from tspd_engine.model.hf_tokenizer import HfTokenizer, load_tokenizer
from tspd_engine.model.source import SMOLLM2, packaged
from tspd_engine.model.tokenizer import ByteTokenizer
from tspd_router.api import GenParams, parse_chat, parse_completion
from tspd_router.completions import Answer, Shape
from tspd_router.config import RouterConfig
from tspd_router.errors import BadRequest
from tspd_router.text import Detokenizer

BYTES = ByteTokenizer()
SMOL = load_tokenizer(packaged(SMOLLM2))
PD = RouterConfig(prefill=("http://p:1",), decode=("http://d:2",))
#: SmolLM2 ids whose text is part of a multi-byte character, or a whole one, or plain words.
PIECES = [*SMOL.encode("héllo wörld — ünïcödé ✓ 中文 日本語 😀🎉 ok"), 2, 0, 1, 198, 28, 30]


def _stream(tok, prompt: list[int], ids: list[int], cuts: list[int]) -> list[str]:
    detok, out, start = Detokenizer(tok, prompt), [], 0
    for cut in [*sorted(cuts), len(ids)]:
        out.append(detok.feed(ids[start:cut]))
        start = max(start, cut)
    out.append(detok.flush())
    return out


@settings(max_examples=200)
@given(
    ids=st.lists(st.sampled_from(PIECES) | st.integers(0, 49151), max_size=24),
    cuts=st.lists(st.integers(0, 24), max_size=8),
)
def test_smollm2_chunks_join_to_the_whole_decode(ids: list[int], cuts: list[int]) -> None:
    pieces = _stream(SMOL, [], ids, cuts)
    whole = SMOL.decode(ids)
    assert "".join(pieces) == whole
    if "\ufffd" not in whole:  # nothing ever went out half-made
        assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=200)
@given(
    ids=st.lists(st.integers(0, 258), max_size=24),
    prompt=st.lists(st.integers(0, 127), max_size=6),
    cuts=st.lists(st.integers(0, 24), max_size=8),
)
def test_byte_chunks_join_to_the_whole_decode(
    ids: list[int], prompt: list[int], cuts: list[int]
) -> None:
    pieces = _stream(BYTES, prompt, ids, cuts)
    assert "".join(pieces) == BYTES.decode(ids)


def test_a_character_split_over_tokens_waits_for_its_last_byte() -> None:
    snow = SMOL.encode("☃")  # three byte-level tokens? at least two: it is split
    assert len(snow) >= 2
    detok = Detokenizer(SMOL, SMOL.encode("A"))
    assert [detok.feed([t]) for t in snow[:-1]] == [""] * (len(snow) - 1)
    assert detok.feed(snow[-1:]) == "☃"
    assert detok.feed([2]) + detok.flush() == ""  # <|im_end|> has no text
    # A prompt the nodes will refuse (ids outside the vocabulary) is no context, not a crash.
    assert Detokenizer(BYTES, [1, 99999]).feed([104, 105]) == "hi"


def _spm() -> HfTokenizer:
    """A SentencePiece-style tokenizer (byte fallback, a "▁" prepended, decoders that strip
    the first space of a sequence), small enough to spell out."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0xC3>": 3, "<0xA9>": 4, "▁": 5, "▁Paris": 6,
             "▁is": 7, "▁nice": 8, "caf": 9, "▁caf": 10}  # fmt: skip
    bpe = models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True)  # decoding only
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    return HfTokenizer(tok, eos_token_ids=[2], bos_token_id=1, add_bos=True)


def test_sentencepiece_keeps_the_space_the_prompt_context_gives() -> None:
    tok = _spm()
    assert tok.decode([6]) == "Paris"  # alone, the sequence's first space is stripped
    detok = Detokenizer(tok, [1, 7, 8])  # "<s> is nice"
    assert detok.feed([6]) == " Paris"
    assert detok.feed([10, 3]) == " caf"  # 0xC3 alone is half of "é"
    assert detok.feed([4]) == "é"
    assert detok.flush() == ""
    cold = Detokenizer(tok)  # no prompt: the output's own first space goes, as decode() does
    assert cold.feed([6, 7]) + cold.flush() == tok.decode([6, 7]) == "Paris is"


# -- chat templates ---------------------------------------------------------------------

LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_templates_render_with_the_special_tokens_and_refuse_with_a_reason() -> None:
    t = ChatTemplate(LLAMA3_STYLE, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    msgs = [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"}]  # fmt: skip
    assert t.render(msgs) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    with pytest.raises(TemplateError, match=r"^the model's chat template refused the "
                       r"conversation: Conversation roles must alternate"):  # fmt: skip
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_template_helpers_and_lenient_fields() -> None:
    t = ChatTemplate(
        "{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}"
        "{% if m.tool_calls %}TOOLS{% endif %}{% endfor %}{% if tools %}T{% endif %}"
        "{{ strftime_now('%Y')|length }}"
    )
    assert t.render([{"role": "user", "content": "<a & b> é"}]) == (
        '{"role": "user", "content": "<a & b> é"}4'
    )


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("{{ date_string }}", r"needs a value this server does not provide: 'date_string' is "
                              r"undefined"),
        ("{{ messages.__class__ }}", r"tried an unsafe operation: access to attribute "
                                     r"'__class__'"),
        ("{{ messages[0].content + 1 }}", r"failed: TypeError: can only concatenate str"),
    ],
)  # fmt: skip
def test_templates_that_cannot_render_say_why(source: str, why: str) -> None:
    with pytest.raises(TemplateError, match=why):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_a_template_that_does_not_compile_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"^the chat template does not compile: line 1: "):
        ChatTemplate("{% for m in messages %}")


# -- what a request carries -------------------------------------------------------------


def test_a_template_refusal_is_a_400_naming_the_messages() -> None:
    two_users = {"model": "m", "messages": [{"role": "user", "content": "a"}] * 2}
    tok = _spm()
    tok.template = ChatTemplate(LLAMA3_STYLE, {"bos_token": "<s>"})
    with pytest.raises(BadRequest, match=r"Conversation roles must alternate") as info:
        parse_chat(two_users, "m", tok, PD)
    assert (info.value.param, info.value.cause, info.value.status) == (
        "messages", "chat_template_error", 400,
    )  # fmt: skip
    with pytest.raises(BadRequest, match=r"^this model has no chat template"):
        parse_chat(two_users, "m", _spm(), PD)


def test_every_eos_id_stops_unless_ignore_eos_and_token_ids_go_out(tmp_path: Path) -> None:
    d = tmp_path / "llama3ish"
    d.mkdir()
    SMOL._tok.save(str(d / "tokenizer.json"))  # type: ignore[attr-defined]
    (d / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0, 5]}))
    tok = load_tokenizer(d)
    body = {"model": "m", "prompt": "hi", "return_token_ids": True}
    api = parse_completion(body, "m", tok, PD)
    assert api.params == GenParams(16, 0, False, (), (0, 5), True)
    assert parse_completion(body | {"ignore_eos": True}, "m", tok, PD).params.stop_token_ids == ()
    shape = Shape(api, "cmpl-1", 7, ("",))
    choice = shape.response([Answer("Hi", "stop", 2, (22, 0))])["choices"][0]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == ("Hi", [22, 0], "stop")
    assert shape.chunk(0, "Hi", None, (22,))["choices"][0]["token_ids"] == [22]
    plain = parse_completion({"model": "m", "prompt": "hi"}, "m", tok, PD)
    assert "token_ids" not in Shape(plain, "c", 7, ("",)).chunk(0, "Hi", None, (22,))["choices"][0]
