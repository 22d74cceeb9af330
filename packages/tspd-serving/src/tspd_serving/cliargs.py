"""The command-line flags every serving program shares (the router, ``python -m tspd_engine``,
the launcher): value types argparse checks alone, ``--model``'s, the HTTP server's time limits
and the chat content flag.

A value argparse can check alone (a port, a count) is refused while parsing, with the flag's
name. The engine's own flags (model, pages, TP, PD transfer) are ``tspd_engine.node.cliargs``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tspd_serving.errors import CheckpointError
from tspd_serving.http import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, HttpLimits
from tspd_serving.models import NAMES, resolve
from tspd_serving.tokenizer import ContentSpecials


def port(text: str) -> int:
    """argparse type: a TCP port, 0 (any free port) to 65535."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is an integer in 0..65535, got {text!r}")
    return value


def count(text: str) -> int:
    """argparse type: an integer >= 1 (ranks, replicas, pages, tokens)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def steps(text: str) -> int:
    """argparse type: an integer >= 0 (0 turns the feature off)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def seconds(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def model_path(text: str) -> Path | None:
    """argparse type: ``--model DIR | FILE.gguf | NAME`` (None: the seeded tiny model)."""
    try:
        return resolve(text)
    except CheckpointError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


MODEL_HELP = (
    "the model: a Hugging Face safetensors directory (Llama, Mistral, Qwen2), a llama GGUF "
    f"file, or a name ({', '.join(NAMES)}; smollm2-135m is SmolLM2-135M-Instruct, installed "
    "by ./nox); default: tiny, the seeded test model"
)


def add_http_args(parser: argparse.ArgumentParser, body_default: float | None = None) -> None:
    """The HTTP server's time limits (every serving role: nodes, router, bootstrap)."""
    g = parser.add_argument_group("HTTP server limits")
    g.add_argument("--header-timeout", type=seconds, default=HEADER_TIMEOUT_S, metavar="S",
                   help="seconds a client may take to send a request's headers, or stay idle "
                        "between requests, before the connection is closed (default: "
                        "%(default)s)")  # fmt: skip
    g.add_argument("--body-timeout", type=seconds, default=body_default or BODY_TIMEOUT_S,
                   metavar="S", help="seconds a request body may take to arrive (408 after; "
                                     "default: %(default)s)")  # fmt: skip


def http_limits(opts: argparse.Namespace) -> HttpLimits:
    """The limits :func:`add_http_args` flags describe."""
    return HttpLimits(header_timeout_s=opts.header_timeout, body_timeout_s=opts.body_timeout)


# -- chat content (a router's flag; ``tspd-launch local`` passes it on to its router) -------

CHAT_CONTENT_HELP = (
    "how special-token text in chat message content is encoded: parse = as the special "
    "tokens it spells, as Hugging Face's apply_chat_template does (a user can then forge "
    "turns, e.g. <|im_end|> then <|im_start|>system); text = as plain text, while the chat "
    "template's own markup still yields its special tokens (default: %(default)s)"
)


def add_chat_content_arg(parser: argparse.ArgumentParser) -> None:
    """``--chat-content-special-tokens {parse,text}`` (:class:`ContentSpecials`)."""
    choices = [c.value for c in ContentSpecials]
    parser.add_argument("--chat-content-special-tokens", choices=choices,
                        default=ContentSpecials.PARSE.value, help=CHAT_CONTENT_HELP)  # fmt: skip
