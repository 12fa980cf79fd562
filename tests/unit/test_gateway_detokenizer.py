"""Incremental detokenization and stop conditions (gateway.detokenizer): hand-built cases with exact
expectations, plus properties over random byte streams and random step boundaries."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher, TurnText


def byte_tok(i: int) -> bytes:
    return bytes([i]) if i < 256 else b""  # ids >= 256: specials without text


def ids(text: str) -> list[int]:
    return list(text.encode())


def stream(tt: TurnText, tokens: list[int], steps: list[int]) -> tuple[str, int]:
    """Push tokens in steps of the given sizes; -> (released text, tokens counted)."""
    out, used, at = [], 0, 0
    for n in [*steps, len(tokens)]:
        chunk = tokens[at : at + n]
        at += n
        text, k = tt.push(chunk)
        out.append(text)
        used += k
        if tt.hit is not None or at >= len(tokens):
            break
    if tt.hit is None:
        out.append(tt.finish())
    return "".join(out), used


def test_multibyte_characters_are_held_back_until_complete():
    d = IncrementalDetokenizer(byte_tok)
    got = [d.push([b]) for b in ids("é日🙂")]
    assert got == ["", "é", "", "", "日", "", "", "", "🙂"]
    assert d.flush() == ""


def test_invalid_bytes_become_one_replacement_each_like_a_one_shot_decode():
    raw = [0xE6, 0x97, 0x41, 0xFF, 0xF0, 0x9F]  # truncated 3-byte char, 'A', a stray byte, a truncated 4-byte char
    d = IncrementalDetokenizer(byte_tok)
    text = "".join(d.push([b]) for b in raw) + d.flush()
    assert text == bytes(raw).decode("utf-8", errors="replace") == "\ufffdA\ufffd\ufffd"


def test_stop_string_across_pushes_is_held_back_then_cut():
    m = StopStringMatcher(["END"])
    assert m.push("abc E") == ("abc ", None)
    assert m.push("N") == ("", None)
    assert m.push("Dxyz") == ("", "END")


def test_held_text_is_released_when_it_stops_being_a_prefix():
    m = StopStringMatcher(["abd", "zz"])
    assert m.push("xab") == ("x", None)
    assert m.push("c") == ("abc", None)
    assert m.push("z") == ("", None)
    assert m.flush() == "z"


def test_earliest_match_wins_over_list_order():
    m = StopStringMatcher(["later", "ear"])
    assert m.push("the early and later") == ("the ", "ear")


def test_turn_text_stop_token_counts_tokens_up_to_it():
    tt = TurnText(byte_tok, stop_token_ids=[257], stop_strings=[])
    assert tt.push([65, 66, 257, 67]) == ("AB", 3)
    assert tt.hit.kind == "token" and tt.hit.token_id == 257 and tt.hit.index == 2
    assert tt.push([68]) == ("", 0) and tt.finish() == ""


def test_turn_text_stop_string_inside_a_split_character():
    """The stop string is a multi-byte character whose bytes arrive in different steps."""
    tokens = ids("ab日cd")
    tt = TurnText(byte_tok, stop_strings=["日"])
    text, used = stream(tt, tokens, [3, 1, 1])
    assert (text, used, tt.hit.string) == ("ab", 5, "日")


def test_stop_string_released_only_at_the_end_when_it_never_completes():
    tt = TurnText(byte_tok, stop_strings=["xyz"])
    text, used = stream(tt, ids("hello xy"), [2, 2, 2])
    assert text == "hello xy" and used == 8 and tt.hit is None


@settings(max_examples=200, deadline=None)
@given(raw=st.lists(st.integers(0, 259), max_size=60), cuts=st.lists(st.integers(1, 5), max_size=30))
def test_streamed_text_equals_a_one_shot_decode(raw, cuts):
    tt = TurnText(byte_tok)
    text, used = stream(tt, raw, cuts)
    assert used == len(raw)
    assert text == b"".join(byte_tok(i) for i in raw).decode("utf-8", errors="replace")


@settings(max_examples=200, deadline=None)
@given(words=st.lists(st.sampled_from(["a", "b", "é", "日", "🙂", " ", "ab"]), max_size=25),
       stop=st.sampled_from(["ab", "é日", "🙂 ", "b🙂", "a a"]), cuts=st.lists(st.integers(1, 4), max_size=40))
def test_stop_strings_are_found_across_any_token_and_step_boundaries(words, stop, cuts):
    full = "".join(words)
    tokens = ids(full)
    tt = TurnText(byte_tok, stop_strings=[stop])
    text, used = stream(tt, tokens, cuts)
    k = full.find(stop)
    if k < 0:
        assert (text, used, tt.hit) == (full, len(tokens), None)
    else:
        assert text == full[:k] and tt.hit.string == stop
        assert used == len((full[: k + len(stop)]).encode())  # up to the token that completed it
