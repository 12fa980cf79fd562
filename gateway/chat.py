"""Chat templates: render a conversation with the model folder's Jinja template (as transformers does).

Rendering uses jinja2's immutable sandbox with transformers' conventions: `trim_blocks`,
`lstrip_blocks`, the loop-controls extension, `raise_exception(msg)`, `strftime_now(fmt)` and a
`tojson` filter; variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools`.

Multi-turn sessions keep their tokens in the verifier's KV cache, so a new turn must be expressed as
text that follows what the session already holds. `ChatTemplate.continuation` finds it by rendering
the conversation with the last reply replaced by a sentinel, with and without the new messages: the
text after the sentinel is what closes the reply, the rest is what the new messages add. A template
that rewrites earlier turns (so the shorter rendering is not a prefix of the longer) raises
`NotAPrefix`; the caller then prefills the whole conversation again.

A folder without a template whose vocabulary has Kimi's chat markers gets `KIMI_TEMPLATE` (the
shape of Kimi K2's template, without its default system prompt): `ddtree init-random --preset tiny`
writes such a vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

KIMI_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_user|>{{ message['role'] }}<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
KIMI_MARKERS = ("<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")
_SENTINEL = "\x00ddtree-reply\x00"


class TemplateError(ValueError):
    """The template failed to render these messages (the text is the template's own message)."""


class NotAPrefix(TemplateError):
    """The template renders earlier turns differently once a new turn follows."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str

    def as_dict(self) -> dict:
        return {"role": self.role, "content": self.content}


def _raise(message: str):
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda v, indent=None, ensure_ascii=False: json.dumps(v, indent=indent,
                                                                                     ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except Exception as e:  # jinja2.TemplateSyntaxError and friends
            raise TemplateError(f"chat template does not compile: {e}") from None
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        try:
            return self.template.render(messages=[m.as_dict() for m in messages],
                                        add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                                        eos_token=self.eos_token or "", tools=None)
        except TemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - any template runtime error is the request's problem
            raise TemplateError(f"chat template failed on these messages: {e}") from None

    def continuation(self, history: list[Message], new: list[Message]) -> tuple[str, str]:
        """`history` ends with the assistant reply the session holds. -> (closing, delta): the text that
        closes that reply as the template renders it, and the text the new messages add (with the
        generation prompt)."""
        if not history or history[-1].role != "assistant":
            raise ValueError("history must end with the assistant's reply")
        prev = [*history[:-1], Message("assistant", _SENTINEL)]
        short = self.render(prev, add_generation_prompt=False)
        long = self.render([*prev, *new], add_generation_prompt=True)
        if _SENTINEL not in short or not long.startswith(short):
            raise NotAPrefix("the chat template renders the conversation differently once a turn follows")
        return short[short.rindex(_SENTINEL) + len(_SENTINEL):], long[len(short):]


def template_for(source: str | None, has_special, bos_token: str | None = None,
                 eos_token: str | None = None) -> ChatTemplate | None:
    """The folder's template; else Kimi's shape when the vocabulary has its markers; else None.
    `has_special(content) -> bool` says whether a special token exists."""
    if source:
        return ChatTemplate(source, bos_token, eos_token)
    if all(has_special(m) for m in KIMI_MARKERS):
        return ChatTemplate(KIMI_TEMPLATE, bos_token, eos_token)
    return None
