"""Chat templates: a model's Jinja template rendered in a sandbox, as Hugging Face does.

A template (``tokenizer_config.json``'s ``chat_template``, a ``chat_template.jinja`` file, a
GGUF's ``tokenizer.chat_template``) turns OpenAI-style messages into the prompt text the model
was trained on. It is untrusted code from a model repository, so it runs in jinja2's
immutable sandbox, with what Hugging Face templates expect:

* variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` (and the
  other special tokens the tokenizer names), ``tools`` and ``documents`` (always None here);
* helpers ``raise_exception(message)``, ``strftime_now(format)``, and a ``tojson`` filter
  that writes JSON as ``json.dumps`` does (jinja's own escapes ``<``, ``>`` and ``&`` for HTML);
* ``trim_blocks`` / ``lstrip_blocks``, loop controls, and ``{% generation %}`` blocks.

A template that calls ``raise_exception`` (roles that do not alternate, say), names a variable
nobody defined, or fails while rendering raises :class:`TemplateError` naming why: the request
gets a 400 with that reason, never a prompt rendered with holes. A missing *field* of a
message (``message.tool_calls``) is undefined-but-falsy, as in transformers, since templates
test for them that way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import missing

from tspd_serving.errors import ConfigError, TemplateError

#: One chat message as templates see it: ``role`` and ``content`` (text).
Message = Mapping[str, Any]


class _TopLevelStrict(jinja2.Undefined):
    """Undefined that fails when a template *uses* a variable no one defined (a value we
    lack) or an attribute the sandbox forbids, but stays falsy and empty for a missing
    attribute or key of a defined object."""

    def _lenient(self) -> bool:
        # The sandbox answers an unsafe attribute with an Undefined carrying SecurityError:
        # that one fails loudly too.
        unsafe = self._undefined_exception is SecurityError
        return self._undefined_obj is not missing and not unsafe

    def __str__(self) -> str:
        return "" if self._lenient() else self._fail_with_undefined_error()

    def __iter__(self) -> Any:
        return iter(()) if self._lenient() else self._fail_with_undefined_error()

    def __len__(self) -> int:
        return 0 if self._lenient() else self._fail_with_undefined_error()

    def __bool__(self) -> bool:
        return False if self._lenient() else self._fail_with_undefined_error()


class _Generation(Extension):
    """``{% generation %}…{% endgeneration %}`` (transformers marks assistant text with it for
    training masks); rendering just emits the body."""

    tags = {"generation"}  # noqa: RUF012  (jinja2 reads the class attribute)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise(message: object) -> NoReturn:
    raise TemplateError(f"the model's chat template refused the conversation: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=_TopLevelStrict,
        extensions=[loopcontrols, _Generation],
        autoescape=False,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_ENV = _environment()


class ChatTemplate:
    """One compiled template and the special-token strings it may use; immutable, and
    rendering is thread-safe (each render gets its own context)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ConfigError("the chat template is empty")
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(
                f"the chat template does not compile: line {exc.lineno}: {exc.message}"
            ) from exc
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (:class:`TemplateError` when the template refuses
        them or cannot render them)."""
        context = {
            **self.special_tokens,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": None,
            "documents": None,
        }
        try:
            return self._template.render(context)
        except TemplateError:
            raise
        except jinja2.UndefinedError as exc:
            why = f"the model's chat template needs a value this server does not provide: {exc}"
            raise TemplateError(why) from exc
        except SecurityError as exc:
            raise TemplateError(
                f"the model's chat template tried an unsafe operation: {exc}"
            ) from exc
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
            KeyError,
            IndexError,
            AttributeError,
        ) as exc:
            raise TemplateError(
                f"the model's chat template failed: {type(exc).__name__}: {exc}"
            ) from exc
