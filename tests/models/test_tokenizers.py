"""Tokenizers from GGUF metadata and from tokenizer.json directories, checked against
transformers' own GGUF tokenizer builder (an independent implementation) on the same files."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tspd_engine.model.config import ModelConfig
from tspd_engine.model.weights import full_random_state
from tspd_serving.errors import CheckpointError, RequestError, TemplateError
from tspd_serving.hf_tokenizer import HfTokenizer, load_tokenizer

from .gguf_files import Vocab, write_gguf

TEXTS = [
    "The capital of France is",
    "Hello world!\n\n  indented\tcode",
    "héllo wörld — ünïcödé ✓ 中文 😀",
    "def f(x):\n    return x**2 + 1",
    "<|im_start|>user\nhi<|im_end|>\n",
    "year 2024, pi 3.14159, 1234567",
    "multiple   spaces  here",
    "It's what they'll say; we've done it.",
]


def _reference(path: Path):  # transformers' tokenizer built from the same GGUF file
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _tiny(vocab: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       intermediate_size=32, bos_token_id=1, eos_token_id=2)  # fmt: skip


def _write(path: Path, vocab: Vocab, template: str | None = None) -> Path:
    cfg = _tiny(len(vocab.tokens))
    write_gguf(path, cfg, full_random_state(cfg, 0), vocab, chat_template=template)
    return path


@pytest.fixture(scope="module")
def smollm2_tok(smollm2: Path) -> HfTokenizer:
    tok = load_tokenizer(smollm2)
    assert isinstance(tok, HfTokenizer)
    return tok


def test_smollm2_gguf_tokenizer_matches_transformers(smollm2: Path, smollm2_tok) -> None:
    ref = _reference(smollm2)
    for text in TEXTS:
        ids = smollm2_tok.encode(text)
        assert ids == ref(text, add_special_tokens=False).input_ids, text
        assert smollm2_tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert smollm2_tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    # llama.cpp's "smollm" pre-tokenizer splits every digit (SmolLM2's own tokenizer.json has
    # a Digits pre-tokenizer too); transformers' GGUF builder does not, but SmolLM2's merges
    # hold no multi-digit token, so both agree here.
    assert smollm2_tok.encode("2024") == [34, 32, 34, 36]
    assert (smollm2_tok.eos_token_ids, smollm2_tok.bos_token_id, smollm2_tok.add_bos) == (
        (2,), 1, False,
    )  # fmt: skip
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert smollm2_tok.chat_prompt(msgs) == ref.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def _spm_vocab() -> Vocab:
    merged = ["▁t", "he", "▁the", "▁a", "in", "▁in", "er", "▁w", "or", "ld", "▁wor", "▁world",
              "ll", "lo", "llo", "▁he", "▁hello", "an", "▁an", "nd", "▁and", "is",
              "▁is"]  # fmt: skip
    chars = ["▁", *string.ascii_letters, *",.!?'"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    types, scores = [2, 3, 3, *[6] * 256], [0.0] * len(tokens)
    for i, piece in enumerate(merged):  # earlier merges score higher, as SentencePiece ranks
        tokens.append(piece)
        types.append(1)
        scores.append(-float(i))
    for i, c in enumerate(chars):
        if c not in tokens:
            tokens.append(c)
            types.append(1)
            scores.append(-1000.0 - i)
    return Vocab("llama", tokens, types, scores=scores, pre=None, bos=1, eos=2,
                 extra={"tokenizer.ggml.unknown_token_id": 0})  # fmt: skip


def test_sentencepiece_gguf_with_merges_from_scores_matches_transformers(tmp_path: Path) -> None:
    vocab = _spm_vocab()
    path = _write(tmp_path / "spm.gguf", vocab)
    ours, ref = load_tokenizer(path), _reference(path)
    texts = ["hello world", "the world and the hello", "Hello, the world!", "héllo wörld ✓",
             "is it in?", "two  spaces", "tail "]  # fmt: skip
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref(text).input_ids, text  # BOS first: llama.cpp's default for SPM
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text
    pieces = [vocab.tokens.index(p) for p in ("▁the", "▁world")]
    assert ours.encode("the world", add_bos=False) == pieces
    # A leading space: llama.cpp (and Llama 2's tokenizer.json) prepend "▁" to the text as
    # is, so " leading" starts with "▁▁"; transformers' Metaspace builder gives one "▁".
    # Ours decodes back to the text.
    assert ours.decode(ours.encode(" leading")) == " leading"


def _byte_level_vocab(pre: str) -> Vocab:
    corpus = [t * 3 for t in TEXTS] + ["the quick brown fox jumps over the lazy dog " * 5]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|end|>", "<|start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    state = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    types = [3 if t in ("<|end|>", "<|start|>") else 1 for t in tokens]
    return Vocab("gpt2", tokens, types, merges=merges, pre=pre, bos=1, eos=0)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2"])
def test_byte_level_gguf_pre_tokenizers_match_transformers(tmp_path: Path, pre: str) -> None:
    path = _write(tmp_path / f"{pre}.gguf", _byte_level_vocab(pre))
    ours, ref = load_tokenizer(path), _reference(path)
    for text in TEXTS:
        ids = ours.encode(text, add_bos=False)
        assert ids == ref(text, add_special_tokens=False).input_ids, (pre, text)
        assert ours.decode(ids) == text


def test_unknown_gguf_tokenizers_are_refused(tmp_path: Path) -> None:
    vocab = _byte_level_vocab("fancy-new-regex")
    with pytest.raises(CheckpointError, match=r"GGUF pre-tokenizer 'fancy-new-regex' is not "
                       r"supported \(supported: default, gpt2, "):  # fmt: skip
        load_tokenizer(_write(tmp_path / "pre.gguf", vocab))
    vocab.model = "bert"
    with pytest.raises(CheckpointError, match=r"GGUF tokenizer model 'bert' is not supported "
                       r"\(supported: gpt2, llama\)$"):  # fmt: skip
        load_tokenizer(_write(tmp_path / "bert.gguf", vocab))


# -- tokenizer.json directories ---------------------------------------------------------


def _directory(tmp_path: Path, smollm2_tok: HfTokenizer, **files: object) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    smollm2_tok._tok.save(str(d / "tokenizer.json"))
    for name, content in files.items():
        target = d / name.replace("__", ".")
        target.write_text(content if isinstance(content, str) else json.dumps(content))
    return d


def test_directory_tokenizer_reads_eos_ids_bos_and_template(tmp_path: Path, smollm2_tok) -> None:
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    d = _directory(tmp_path, smollm2_tok,
                   config__json={"eos_token_id": 2},
                   generation_config__json={"eos_token_id": [2, 0]},
                   tokenizer_config__json={"bos_token": "<|im_start|>",
                                           "eos_token": {"content": "<repo_name>"},
                                           "add_bos_token": True, "chat_template": "unused"},
                   chat_template__jinja=template)  # fmt: skip
    tok = load_tokenizer(d)
    assert isinstance(tok, HfTokenizer)
    assert tok.eos_token_ids == (2, 0, 3)  # config.json's first: the one the engine stops on
    assert tok.encode("The capital") == [1, 504, 3575]  # add_bos_token: BOS first
    assert tok.encode("The capital", add_bos=False) == [504, 3575]
    msgs = [{"role": "user", "content": "hi"}]
    # chat_template.jinja wins over tokenizer_config.json's; the text gets no second BOS.
    assert tok.chat_prompt(msgs) == smollm2_tok.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.template is not None
    assert tok.template.special_tokens["eos_token"] == "<repo_name>"


def test_bos_follows_the_post_processor_when_the_config_is_silent(
    tmp_path: Path, smollm2_tok
) -> None:
    d = _directory(tmp_path, smollm2_tok, tokenizer_config__json={"bos_token": "<|im_start|>"},
                   config__json={"eos_token_id": 2})  # fmt: skip
    assert load_tokenizer(d).encode("The") == [504]  # tokenizer.json adds nothing
    raw = Tokenizer.from_str(smollm2_tok._tok.to_str())  # a copy: the fixture is shared
    raw.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    raw.save(str(d / "tokenizer.json"))
    assert load_tokenizer(d).encode("The") == [1, 504]


def test_directory_tokenizers_refused_with_the_file(tmp_path: Path, smollm2_tok) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"empty has no tokenizer\.json \(tspd reads "):
        load_tokenizer(empty)
    d = _directory(tmp_path, smollm2_tok, config__json={"eos_token_id": 2})
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is not a valid tokenizer file: "):
        load_tokenizer(d)
    d = _directory(tmp_path, smollm2_tok, tokenizer_config__json={"eos_token": "<nope>"})
    with pytest.raises(CheckpointError, match=r"special token '<nope>' is not in tokenizer\.json"):
        load_tokenizer(d)
    d = _directory(tmp_path, smollm2_tok, tokenizer_config__json={})
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"the tokenizer names no EOS token$"):
        load_tokenizer(d)


def test_decoding_unknown_ids_and_chatting_without_a_template_are_refused(
    tmp_path: Path, smollm2_tok
) -> None:
    with pytest.raises(RequestError, match=r"^token id 49152 outside the vocabulary 0\.\.49151$"):
        smollm2_tok.decode([5, 49152])
    d = _directory(tmp_path, smollm2_tok, config__json={"eos_token_id": 2})
    with pytest.raises(TemplateError, match=r"^this model has no chat template \(use "):
        load_tokenizer(d).chat_prompt([{"role": "user", "content": "hi"}])


def test_byte_level_decoder_alone_is_what_gguf_gpt2_uses() -> None:
    # Guard for the assumption the incremental detokenizer relies on: an incomplete UTF-8
    # tail decodes to U+FFFD, which the detokenizer holds back.
    tok = Tokenizer(models.BPE())
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(["Ã", "©"])  # "é" is bytes C3 A9, spelled Ã© in the byte alphabet
    assert tok.decode([0]) == "\ufffd"
    assert tok.decode([0, 1]) == "é"
