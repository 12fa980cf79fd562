"""Chat templates (gateway.chat) and turn planning (gateway.turns): rendering with transformers'
conventions, the continuation text of a session's next turn, the fallback when a template rewrites
history, and what a session turn sends to the verifier."""

from __future__ import annotations

import pytest

from gateway.chat import KIMI_TEMPLATE, ChatTemplate, Message, NotAPrefix, TemplateError, template_for
from gateway.errors import GatewayError
from gateway.sessions import Session
from gateway.text_tokenizer import load_text_tokenizer
from gateway.turns import TurnInput, TurnPlanner

U1, U2 = [Message("user", "hi")], [Message("user", "again")]


def test_kimi_shape_renders_and_continues():
    t = ChatTemplate(KIMI_TEMPLATE)
    text = t.render([Message("system", "S"), *U1], add_generation_prompt=True)
    assert text == ("<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|>")
    closing, delta = t.continuation([*U1, Message("assistant", "yo")], U2)
    assert closing == "<|im_end|>"
    assert delta == "<|im_user|>user<|im_middle|>again<|im_end|><|im_assistant|>assistant<|im_middle|>"


def test_transformers_conventions():
    src = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no ' + m.role) }}"
           "{% endif %}{{ m | tojson }}\n{% endfor %}")
    t = ChatTemplate(src, bos_token="<s>")
    assert t.render([Message("user", "é")], False) == '<s>{"role": "user", "content": "é"}\n'
    with pytest.raises(TemplateError, match="no bad"):
        t.render([Message("bad", "x")], False)
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_template_that_rewrites_history_is_detected():
    # drops every assistant message but the last, like templates that strip earlier reasoning
    src = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}[{{ m.role }}]{{ m.content }}"
           "{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    with pytest.raises(NotAPrefix):
        ChatTemplate(src).continuation([*U1, Message("assistant", "yo")], U2)


def test_template_for_falls_back_to_kimi_only_with_its_markers():
    names = {"<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"}
    assert template_for(None, names.__contains__).source == KIMI_TEMPLATE
    assert template_for(None, lambda c: False) is None
    assert template_for("X", lambda c: False).source == "X"


@pytest.fixture
def planner(tiny_dirs):
    tok = load_text_tokenizer(tiny_dirs[0])
    return TurnPlanner(tok, ChatTemplate(KIMI_TEMPLATE), 320), tok


def test_session_turns_send_only_what_is_new(planner):
    p, tok = planner
    s = Session("s-1", "v")
    first = p.session_turn(s, TurnInput(messages=tuple(U1)))
    assert not first.continue_session and first.send == first.context and first.cached == 0
    # the turn happened: the session holds the context and a reply that ended with <|im_end|> (258)
    s.tokens, s.verifier_sid, s.last_stop_token = first.context + [104, 258], "s-1.1", 258
    s.messages = [*U1, Message("assistant", "h")]
    nxt = p.session_turn(s, TurnInput(messages=tuple(U2)))
    expected = tok.encode("<|im_user|>user<|im_middle|>again<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert nxt.continue_session and nxt.send == expected  # the closing marker was already generated
    assert nxt.cached == len(s.tokens) - 1 and nxt.context == s.tokens + expected  # last reply token re-prefilled
    s.last_stop_token = None  # ended by length: the closing marker is added
    assert p.session_turn(s, TurnInput(messages=tuple(U2))).send == [258, *expected]
    raw = p.session_turn(s, TurnInput(token_ids=(1, 2)))
    assert raw.send == [1, 2] and raw.continue_session
    s.verifier_sid = None  # the verifier lost it: everything is sent again
    again = p.session_turn(s, TurnInput(token_ids=(1, 2)))
    assert not again.continue_session and again.send == s.tokens + [1, 2]


def test_planner_errors_name_the_field(planner):
    p, _ = planner
    with pytest.raises(GatewayError, match="^INVALID_ARGUMENT: token_ids: token ids \\[999\\]"):
        p.one_shot(TurnInput(token_ids=(1, 999)))
    with pytest.raises(GatewayError, match="^INVALID_ARGUMENT: prompt: the prompt is empty"):
        p.one_shot(TurnInput(text=""))
    with pytest.raises(GatewayError, match="^INVALID_ARGUMENT: messages\\[0\\].role"):
        p.one_shot(TurnInput(messages=(Message("", "x"),)))
    no_template = TurnPlanner(p.tok, None, 320)
    with pytest.raises(GatewayError, match="^INVALID_ARGUMENT: messages: this model has no chat template"):
        no_template.one_shot(TurnInput(messages=tuple(U1)))
