"""A ``tokenizers.Tokenizer`` rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata.

A GGUF carries no ``tokenizer.json``: llama.cpp stores the vocabulary, the merges, each
token's type and score, and the name of its pre-tokenizer. Two models are rebuilt here, to
tokenize as llama.cpp does:

* ``gpt2``: byte-level BPE with the file's merges. The pre-tokenizer comes from
  ``tokenizer.ggml.pre``: GPT-2's split (``default``, ``gpt2``, ...), GPT-2's after one
  token per digit (``smollm``, ``starcoder``, ...: llama.cpp splits ``\\p{N}`` first for
  them, as SmolLM2's own ``tokenizer.json`` does with a ``Digits`` pre-tokenizer), Llama 3's
  (``llama-bpe``) or Qwen2's split. Another name is refused: guessing the split would
  tokenize differently from the model's training without a word.
* ``llama``: SentencePiece-style BPE with byte fallback: spaces become ``▁`` and one is
  prepended (``tokenizer.ggml.add_space_prefix``, default on), unknown characters fall back
  to ``<0xNN>`` byte tokens; without stored merges they are derived from the token scores
  (a merge ranks by the score of the piece it makes, as SentencePiece merges).

Control tokens (type 3) become special added tokens (never split from text, skipped when
decoding), user-defined ones (type 4) plain added tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from tspd_serving.errors import CheckpointError
from tspd_serving.gguf_file import GgufFile

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
_GPT2 = ("default", "gpt2", "mpt", "olmo", "jais")
_DIGITS_FIRST = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3, "llama3": _LLAMA3, "qwen2": _QWEN2}
PRE_TOKENIZERS = (*_GPT2, *_DIGITS_FIRST, *_SPLITS)
MODELS = ("gpt2", "llama")


def gguf_tokenizer(f: GgufFile) -> Tokenizer:
    """The tokenizer ``f`` describes (:class:`CheckpointError` naming what is unsupported)."""
    model = f.get("tokenizer.ggml.model")
    tokens = f.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(f"{f.path} has no tokenizer.ggml.tokens: it carries no tokenizer")
    types = f.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{f.path}: {len(types)} token types for {len(tokens)} tokens")
    if model == "gpt2":
        tok = _byte_level(f, tokens)
    elif model == "llama":
        tok = _sentencepiece(f, tokens, types)
    else:
        raise CheckpointError(
            f"{f.path}: GGUF tokenizer model {model!r} is not supported "
            f"(supported: {', '.join(MODELS)})"
        )
    added = [
        AddedToken(t, special=kind == CONTROL, normalized=False)
        for t, kind in zip(tokens, types, strict=True)
        if kind in (CONTROL, USER_DEFINED)
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return tok


def _merges(f: GgufFile) -> list[tuple[str, str]] | None:
    raw = f.get("tokenizer.ggml.merges")
    if raw is None:
        return None
    merges = []
    for m in raw:
        left, sep, right = m.partition(" ")
        if not sep:
            raise CheckpointError(f"{f.path}: merge {m!r} is not two tokens")
        merges.append((left, right))
    return merges


def _byte_level(f: GgufFile, tokens: list[str]) -> Tokenizer:
    merges = _merges(f)
    if merges is None:
        raise CheckpointError(f"{f.path}: a gpt2 tokenizer needs tokenizer.ggml.merges")
    pre = str(f.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{f.path}: GGUF pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(PRE_TOKENIZERS)})"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    # Llama 3's tokenizer.json takes a whole word from the vocabulary before merging.
    bpe = models.BPE(vocab, merges, ignore_merges=pre in ("llama-bpe", "llama3"))
    tok = Tokenizer(bpe)
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGITS_FIRST:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), gpt2]
        )
    else:
        tok.pre_tokenizer = gpt2
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(f: GgufFile, tokens: list[str], types: Sequence[int]) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges(f)
    if merges is None:
        scores = f.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise CheckpointError(f"{f.path}: a llama tokenizer needs merges or token scores")
        merges = _merges_from_scores(tokens, types, scores)
    unk_id = f.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    bpe = models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", "▁")
    tok.normalizer = (
        normalizers.Sequence([normalizers.Prepend("▁"), replace]) if prefix else replace
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tok


def _merges_from_scores(
    tokens: list[str], types: Sequence[int], scores: Sequence[float]
) -> list[tuple[str, str]]:
    """Every (left, right) split of a normal token into two normal tokens, best merged piece
    first (ties: by the ids of the two parts)."""
    normal = {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece in normal:
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[normal[piece]], normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
