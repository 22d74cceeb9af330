"""OpenAI request bodies to what a front door generates, with clear refusals.

``/v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or a list
of such lists (one choice per prompt). ``/v1/chat/completions``: ``messages`` through the
served model's chat template (:mod:`tspd_serving.openai.chat`). Both take ``max_tokens`` (chat also
``max_completion_tokens``), ``stream`` with ``stream_options.include_usage``, ``stop`` (a string
or up to 4), ``seed`` (ignored: decoding is greedy) and vLLM's ``min_tokens`` / ``ignore_eos`` /
``return_token_ids`` (each choice, and each stream chunk, also carries its ``token_ids``).

Prompt text is measured against the context limit before it is tokenized
(:func:`tspd_serving.openai.limits.check_text`). Parsing is pure and thread-safe: the router
and the nodes run it on worker threads, off the event loop. What a deployment accepts comes
from :class:`ApiOptions` (the router's config, or a node's :class:`ApiDefaults`).

Generation ends at any of the tokenizer's EOS ids (a model may have several: they go to the
nodes as stop token ids beside the model's own EOS), unless ``ignore_eos``.

The reference engine decodes greedily, so ``temperature`` > 0 and ``top_p`` < 1 are refused
(``accept_sampling`` decodes them greedily instead); ``n`` > 1, ``best_of``
> 1, ``logprobs``, penalties, ``logit_bias``, ``suffix``, tools and non-text response formats
are refused. Unknown keys are ignored, as OpenAI's clients add new ones over time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from tspd_serving.openai.chat import chat_prompt
from tspd_serving.openai.errors import BadRequest, UnknownModel
from tspd_serving.openai.limits import UNKNOWN, ModelLimits, check_text
from tspd_serving.tokenizer import ContentSpecials, Tokenizer

MAX_PROMPTS = 64
MAX_STOPS = 4
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
#: ``max_tokens`` of a chat completion that names none, by default (OpenAI's is the context).
CHAT_MAX_TOKENS = 256


class ApiOptions(Protocol):
    """What a deployment accepts beyond OpenAI's defaults (the router's ``RouterConfig``
    has these fields)."""

    @property
    def accept_sampling(self) -> bool:
        """Decode requests asking for sampling greedily instead of refusing them."""
        ...

    @property
    def chat_max_tokens(self) -> int:
        """``max_tokens`` of a chat completion that names none."""
        ...

    @property
    def chat_content_special_tokens(self) -> ContentSpecials:
        """How special-token text in chat message content is encoded."""
        ...


@dataclass(frozen=True, slots=True)
class ApiDefaults:
    """:class:`ApiOptions` with the router's defaults (a node's OpenAI routes)."""

    accept_sampling: bool = False
    chat_max_tokens: int = CHAT_MAX_TOKENS
    chat_content_special_tokens: ContentSpecials = ContentSpecials.PARSE


@dataclass(frozen=True, slots=True)
class GenParams:
    """What every choice of one request is generated with."""

    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    #: EOS ids beyond the model's own (the tokenizer's other end-of-generation ids).
    stop_token_ids: tuple[int, ...] = ()
    #: vLLM's ``return_token_ids``: the generated ids go out beside the text.
    return_token_ids: bool = False


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """One parsed OpenAI request: one prompt per choice."""

    chat: bool
    model: str
    prompts: tuple[tuple[int, ...], ...]
    params: GenParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False

    @property
    def param(self) -> str:
        """The body field the prompts came from (what a refusal names)."""
        return "messages" if self.chat else "prompt"


def parse_completion(
    body: Any,
    served: str | None,
    tokenizer: Tokenizer,
    cfg: ApiOptions,
    limits: ModelLimits = UNKNOWN,
) -> ApiRequest:
    body = _common(body, served, cfg)
    if body.get("suffix"):
        raise BadRequest("'suffix' (insertion) is not supported", "suffix")
    if _int(body, "best_of", 1, 1) != 1:
        raise BadRequest("'best_of' > 1 is not supported: decoding is greedy", "best_of")
    if body.get("logprobs") is not None:
        raise BadRequest("'logprobs' is not supported by this deployment", "logprobs")
    echo = _flag(body, "echo")
    prompts = _prompts(body.get("prompt"), tokenizer, limits)
    params = _params(body, _int(body, "max_tokens", COMPLETION_MAX_TOKENS, 1), tokenizer)
    stream, usage = _stream(body)
    return ApiRequest(False, str(body["model"]), prompts, params, stream, usage, echo)


def parse_chat(
    body: Any,
    served: str | None,
    tokenizer: Tokenizer,
    cfg: ApiOptions,
    limits: ModelLimits = UNKNOWN,
) -> ApiRequest:
    body = _common(body, served, cfg)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise BadRequest("'logprobs' is not supported by this deployment", "logprobs")
    if body.get("tools") or body.get("functions") or body.get("tool_choice") not in (None, "none"):
        raise BadRequest("tools and function calling are not supported by this model", "tools")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise BadRequest("only the 'text' response format is supported", "response_format")
    prompt = chat_prompt(body.get("messages"), tokenizer, limits, cfg.chat_content_special_tokens)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = _params(body, _int(body, key, cfg.chat_max_tokens, 1), tokenizer)
    stream, usage = _stream(body)
    return ApiRequest(True, str(body["model"]), (prompt,), params, stream, usage)


def _common(body: Any, served: str | None, cfg: ApiOptions) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required (see GET /v1/models)", "model")
    # ``served`` is None while no node was ever reached: the name cannot be checked, and
    # the request fails on the missing node (503) rather than on a name nobody reported.
    if served is not None and model != served:
        raise UnknownModel(model, served)
    if _int(body, "n", 1, 1) != 1:
        raise BadRequest("'n' > 1 is not supported: greedy decoding gives n equal answers", "n")
    _sampling(body, cfg)
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}
    for key, value in neutral.items():
        given = body.get(key)
        if given is not None and not _is_number(given, value):
            raise BadRequest(f"'{key}' is not supported by this deployment", key)
    if body.get("logit_bias"):
        raise BadRequest("'logit_bias' is not supported by this deployment", "logit_bias")
    seed = body.get("seed")
    if seed is not None and type(seed) is not int:
        raise BadRequest("'seed' must be an integer", "seed")
    return body


def _sampling(body: dict[str, Any], cfg: ApiOptions) -> None:
    temperature, top_p = body.get("temperature"), body.get("top_p")
    for key, value, low, high in (("temperature", temperature, 0, 2), ("top_p", top_p, 0, 1)):
        if value is not None and (type(value) not in (int, float) or not low <= value <= high):
            raise BadRequest(f"'{key}' must be a number in [{low}, {high}]", key)
    sampling = (temperature or 0) > 0 or (top_p is not None and top_p < 1)
    if sampling and not cfg.accept_sampling:
        raise BadRequest(
            "this deployment decodes greedily: leave 'temperature' out or set it to 0 "
            f"(got temperature={temperature}, top_p={top_p})",
            "temperature",
            "sampling_not_supported",
        )


def _prompts(raw: Any, tokenizer: Tokenizer, limits: ModelLimits) -> tuple[tuple[int, ...], ...]:
    if isinstance(raw, str):
        return (_encode(raw, tokenizer, limits, "the prompt"),)
    if isinstance(raw, list) and raw:
        if all(type(t) is int for t in raw):
            return (tuple(raw),)
        if len(raw) > MAX_PROMPTS:
            raise BadRequest(f"at most {MAX_PROMPTS} prompts per request", "prompt")
        if all(isinstance(p, str) for p in raw):
            return tuple(_encode(p, tokenizer, limits, f"prompt {i}") for i, p in enumerate(raw))
        if all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in raw):
            return tuple(tuple(p) for p in raw)
    raise BadRequest(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of "
        "non-empty lists of token ids",
        "prompt",
    )


def _encode(text: str, tokenizer: Tokenizer, limits: ModelLimits, which: str) -> tuple[int, ...]:
    """The ids of one prompt text, unless it cannot fit the context (checked first)."""
    least = len(tokenizer.encode("")) + tokenizer.least_tokens(text)  # a BOS, if any, too
    nbytes = len(text.encode("utf-8", "surrogatepass"))
    check_text(nbytes, least, tokenizer.max_token_bytes, limits, which, "prompt")
    return tuple(tokenizer.encode(text))


def _params(body: dict[str, Any], max_tokens: int, tokenizer: Tokenizer) -> GenParams:
    min_tokens = _int(body, "min_tokens", 0, 0)
    if min_tokens > max_tokens:
        raise BadRequest("'min_tokens' must not exceed 'max_tokens'", "min_tokens")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list | tuple) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"at most {MAX_STOPS} stop strings", "stop")
    ignore_eos = _flag(body, "ignore_eos")
    # The first EOS id is the model's own, which the nodes stop on already.
    extra = () if ignore_eos else tokenizer.eos_token_ids[1:]
    return GenParams(
        max_tokens, min_tokens, ignore_eos, tuple(stops), extra, _flag(body, "return_token_ids")
    )


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise BadRequest("'stream_options' is only allowed with 'stream': true", "stream_options")
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    return stream, _flag(options, "include_usage")


def _int(body: dict[str, Any], key: str, default: int, low: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if type(value) is not int or value < low:
        raise BadRequest(f"'{key}' must be an integer >= {low}", key)
    return value


def _is_number(value: object, expected: float) -> bool:
    """``value`` is the JSON number ``expected`` (``true`` is not 1, nor ``false`` 0)."""
    return type(value) in (int, float) and value == expected


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be true or false", key)
    return value
