"""Streaming text out of streamed tokens: incremental UTF-8 detokenization and stop conditions.

`IncrementalDetokenizer` turns tokens into text as they arrive and never emits a broken character: the
bytes of a character split across tokens (or steps) are held back until it is complete. Bytes that
can never form a character become U+FFFD at once, exactly as a one-shot
`bytes.decode("utf-8", errors="replace")` of the whole output would, so the concatenated deltas always
equal the one-shot decode.

`StopStringMatcher` finds stop strings in the text stream, also when one spans tokens, steps or
characters that were held back: text that could still be the beginning of a stop string is held
back until it is decided, and the text before the first match is all that is ever released.

`TurnText` combines both with stop token ids, token by token, and remembers which token ended the
turn (so usage counts exactly the tokens up to it).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable
from dataclasses import dataclass


class IncrementalDetokenizer:
    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Iterable[int]) -> str:
        """Text completed by these tokens (possibly "" while a character is incomplete)."""
        return self._utf8.decode(b"".join(self._token_bytes(i) for i in ids))

    def flush(self) -> str:
        """End of stream: an incomplete trailing character becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)


class StopStringMatcher:
    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""  # released to nobody yet: could be the start of a stop string

    def push(self, text: str) -> tuple[str, str | None]:
        """-> (text safe to release, the stop string that matched or None). After a match the caller
        stops; the text from the match on is never released."""
        if not self.stops:
            return text, None
        buf = self._held + text
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self._held = ""
            return buf[: best[0]], best[1]
        hold = 0  # longest suffix of buf that is a proper prefix of some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


@dataclass
class StopHit:
    kind: str  # "token" | "string"
    index: int  # index in the pushed tokens of the token that ended the turn
    token_id: int | None = None
    string: str | None = None


class TurnText:
    """Tokens in, releasable text out, with stop token ids and stop strings applied."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop_token_ids: Iterable[int] = (),
                 stop_strings: Iterable[str] = ()):
        self.detok = IncrementalDetokenizer(token_bytes)
        self.matcher = StopStringMatcher(stop_strings)
        self.stop_ids = frozenset(stop_token_ids)
        self.hit: StopHit | None = None

    def push(self, ids: list[int]) -> tuple[str, int]:
        """-> (text to release, how many of `ids` belong to the output). When a stop token or string
        ends the turn, `self.hit` is set and the count includes the token that ended it."""
        if self.hit is not None:
            return "", 0
        out: list[str] = []
        for k, t in enumerate(ids):
            if t in self.stop_ids:
                self.hit = StopHit("token", k, token_id=t)
                return "".join(out), k + 1
            text, matched = self.matcher.push(self.detok.push([t]))
            out.append(text)
            if matched is not None:
                self.hit = StopHit("string", k, string=matched)
                return "".join(out), k + 1
        return "".join(out), len(ids)

    def finish(self) -> str:
        """The turn ended without a stop match: release what was held back."""
        if self.hit is not None:
            return ""
        text, matched = self.matcher.push(self.detok.flush())
        if matched is not None:
            self.hit = StopHit("string", -1, string=matched)
            return text
        return text + self.matcher.flush()
