"""What a turn sends to the verifier: the request's input turned into token ids, for one-shot requests and
for turns of a multi-turn session (`TurnPlan`), and what the session holds after the turn.

Inputs: `text` (encoded; special-token strings become their ids), `token_ids` (checked against the
vocabulary) or chat `messages` (rendered with the chat template, `add_generation_prompt`). In a
session a chat turn is rendered as the template's continuation of the conversation so far
(`ChatTemplate.continuation`), and the reply's closing marker is added unless the reply already ended
with it (its stop token); a template that rewrites earlier turns makes the turn re-render the whole
conversation and prefill it into a fresh verifier session.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.chat import ChatTemplate, Message, NotAPrefix, TemplateError
from gateway.errors import GatewayError, invalid
from gateway.sessions import Session
from gateway.text_tokenizer import CHAT_END_MARKERS, TextTokenizer


@dataclass(frozen=True)
class TurnInput:
    """Exactly one of text / token_ids / messages."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[Message, ...] | None = None
    add_special_tokens: bool = True  # text as transformers' tokenizer(text) encodes it (not inside a session)
    ids_field: str = "token_ids"  # how the surface names token ids in errors ("prompt" for OpenAI completions)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass
class TurnPlan:
    send: list[int]  # tokens for the verifier: the new ones (continue) or the whole context (open)
    continue_session: bool
    context: list[int]  # everything the reply is generated after (history + this turn's input)
    cached: int  # tokens of `context` already in the verifier's KV cache
    messages_after: list[Message] | None  # the chat after this turn's input (the reply is appended later)


def check_ids(ids, vocab_size: int, field: str) -> list[int]:
    ids = list(ids)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise invalid(field, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return ids


def check_messages(messages) -> list[Message]:
    if not messages:
        raise invalid("messages", "at least one message is needed")
    for i, m in enumerate(messages):
        if not m.role:
            raise invalid(f"messages[{i}].role", "a role is needed (system, user, assistant, ...)")
    return list(messages)


class TurnPlanner:
    def __init__(self, tokenizer: TextTokenizer, template: ChatTemplate | None, vocab_size: int):
        self.tok = tokenizer
        self.template = template
        self.vocab_size = vocab_size

    def _template(self) -> ChatTemplate:
        if self.template is None:
            raise invalid("messages", "this model has no chat template (tokenizer_config.json chat_template or "
                                      "chat_template.jinja); send text or token ids instead")
        return self.template

    def _encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return check_ids(self.tok.encode(text, add_special_tokens), self.vocab_size, "prompt")

    def _render(self, messages: list[Message]) -> list[int]:
        try:
            return self._encode(self._template().render(messages, add_generation_prompt=True))
        except TemplateError as e:
            raise invalid("messages", str(e)) from None

    def tokens(self, inp: TurnInput) -> list[int]:
        """The input on its own (one-shot requests, or a session's first turn)."""
        if inp.token_ids is not None:
            return check_ids(inp.token_ids, self.vocab_size, inp.ids_field)
        if inp.messages is not None:
            return self._render(check_messages(inp.messages))
        return self._encode(inp.text or "", inp.add_special_tokens)

    def one_shot(self, inp: TurnInput) -> TurnPlan:
        tokens = self.tokens(inp)
        if not tokens:
            raise invalid("prompt", "the prompt is empty")
        return TurnPlan(tokens, False, tokens, 0, None)

    def session_turn(self, s: Session, inp: TurnInput) -> TurnPlan:
        history = list(s.tokens)
        messages_after = None
        if inp.is_chat:
            new_msgs = check_messages(inp.messages)
            if s.messages:
                try:
                    new = self._chat_continuation(s, new_msgs)
                except NotAPrefix:  # the template rewrites history: prefill the re-rendered conversation
                    full = self._render([*s.messages, *new_msgs])
                    return TurnPlan(full, False, full, 0, [*s.messages, *new_msgs])
                messages_after = [*s.messages, *new_msgs]
            else:
                new = self._render(new_msgs)
                messages_after = new_msgs if not history else None
        elif history and inp.text is not None:
            new = self._encode(inp.text)  # mid-conversation: nothing (no BOS) is added around the text
        else:
            new = self.tokens(inp)
        context = history + new
        if not context:
            raise invalid("prompt", "the first turn of a session needs a non-empty prompt")
        if s.verifier_sid is not None and history:
            # the last history token (the previous turn's final output) has no KV yet: the verifier
            # prefills it with the new tokens, so it is not counted as cached
            return TurnPlan(new, True, context, len(history) - 1, messages_after)
        return TurnPlan(context, False, context, 0, messages_after)

    def _chat_continuation(self, s: Session, new_msgs: list[Message]) -> list[int]:
        """NotAPrefix propagates (the caller re-renders everything)."""
        template = self._template()
        try:
            closing, delta = template.continuation(s.messages, new_msgs)
        except NotAPrefix:
            raise
        except TemplateError as e:
            raise invalid("messages", str(e)) from None
        marker = self._special_content(s.last_stop_token) if s.last_stop_token is not None else None
        if marker and closing.startswith(marker):  # the reply already ended with its closing marker
            closing = closing[len(marker):]
        return self._encode(closing + delta)

    def _special_content(self, token_id: int) -> str | None:
        for content in (*CHAT_END_MARKERS, self.tok.eos_token):
            if content and self.tok.special_id(content) == token_id:
                return content
        return None


def require_input(inp: TurnInput) -> None:
    given = [n for n, v in (("text", inp.text), ("token_ids", inp.token_ids), ("messages", inp.messages))
             if v is not None]
    if len(given) != 1:
        raise GatewayError("INVALID_ARGUMENT", f"input: exactly one of text, token_ids or messages is needed, "
                                               f"got {given or 'none'}", "input")
