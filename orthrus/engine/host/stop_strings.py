"""Stop strings inside the engine: incremental detection, then an exact cut of the row's tokens; and
the decoded completion of every finished row (``RequestOutput.text``) when the engine has a tokenizer.

Only rows that have stop strings are detokenized, and only a window of their newest tokens per
iteration: the tokens added since the last scan plus an overlap long enough to hold any stop string
that began before them (a character can take up to 4 byte-level tokens, and skipped special tokens
take none, hence the generous overlap). Text is decoded the way the pipeline decodes completions
(``skip_special_tokens=True``). When a window holds a stop string, the whole completion is decoded
once to place the cut exactly. A row that ends otherwise is decoded once, as it finishes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StopHit:
    """Where a row's completion ends: its first ``keep`` tokens, the text before the stop, the stop,
    and ``end``, the number of tokens up to the one that completed the stop string."""

    keep: int
    text: str
    stop: str
    end: int


class StopStringScanner:
    """Detects stop strings in generated tokens with a tokenizer (any HF tokenizer's ``decode``), and
    decodes finished rows."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # A tokenizer that cleans up no spaces decodes exactly as its Rust tokenizer, whose
        # ``decode`` skips transformers' argument conversion (a Python walk over every id): a
        # fraction of the cost at a few tokens per row, where decoding weighs as much as the frame.
        direct = not getattr(tokenizer, "clean_up_tokenization_spaces", True) and hasattr(tokenizer,
                                                                                         "backend_tokenizer")
        self._decode = tokenizer.backend_tokenizer.decode if direct else tokenizer.decode

    def decode(self, ids: Sequence[int]) -> str:
        """Completion text of ``ids``."""
        return self._decode(list(ids), skip_special_tokens=True)

    def completion(self, tokens: list[int], ends_on_stop_token: bool) -> str | None:
        """The text of a row that no stop string cut: its ids without the stop token that ended it
        (EOS or one of ``stop_token_ids``: not part of the text, as in vLLM), or None when they
        cannot be decoded (a caller that decodes them itself then reports why)."""
        try:
            return self.decode(tokens[:-1] if ends_on_stop_token else tokens)
        except Exception:  # noqa: BLE001 - this row's ids are the problem, not the engine's
            return None

    def scan(self, tokens: np.ndarray, scanned: int, stops: tuple[str, ...]) -> StopHit | None:
        """Search ``tokens`` (all generated so far; the first ``scanned`` were searched before)."""
        overlap = 4 * max(len(s) for s in stops) + 8
        window = self.decode(tokens[max(0, scanned - overlap):].tolist())  # SYNC: none (host numpy)
        if not any(s in window for s in stops):
            return None
        return self.cut(tokens, stops)

    def cut(self, tokens: np.ndarray, stops: tuple[str, ...]) -> StopHit | None:
        """The earliest stop string in the completion and the longest token prefix before it."""
        ids = tokens.tolist()  # SYNC: none (host numpy)
        text = self.decode(ids)
        hits = [(text.find(s), s) for s in stops if s in text]
        if not hits:
            return None
        at, stop = min(hits)
        before = text[:at]
        lo, hi = 0, len(ids)               # largest prefix whose text stays within `before`
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self.decode(ids[:mid])) <= at:
                lo = mid
            else:
                hi = mid - 1
        while lo and not before.startswith(self.decode(ids[:lo])):   # a partial character at the end
            lo -= 1
        end, hi = lo + 1, len(ids)         # smallest prefix whose text holds the stop string
        while end < hi:
            mid = (end + hi) // 2
            if stop in self.decode(ids[:mid]):
                hi = mid
            else:
                end = mid + 1
        return StopHit(lo, before, stop, end)
