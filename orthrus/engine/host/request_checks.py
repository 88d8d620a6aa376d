"""What an engine accepts: one rule for a request (its prompt's length and id range, its params),
applied to one request (``OrthrusEngine.check_request``) or to many at once from Arrow's list layout
(one flat id array and row offsets, ``OrthrusEngine.check_requests``: no array per row)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from orthrus.engine.host.grammar import SlotGrammars
from orthrus.params import SamplingParams


@dataclass(frozen=True)
class PromptBounds:
    """Per row: the prompt's length and its smallest and largest token id (0 and 0 when empty)."""

    lengths: np.ndarray
    lowest: np.ndarray
    highest: np.ndarray


def prompt_bounds(token_ids: np.ndarray, offsets: np.ndarray) -> PromptBounds:
    """Row ``i`` holds ``token_ids[offsets[i]:offsets[i + 1]]``; raises ``ValueError`` if the ids are not integers."""
    offsets = np.asarray(offsets, dtype=np.int64)
    flat = np.asarray(token_ids)
    if flat.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be an integer array, got {flat.dtype}")
    lengths = np.diff(offsets)
    lowest = np.zeros(len(lengths), np.int64)
    highest = np.zeros(len(lengths), np.int64)
    filled = np.flatnonzero(lengths > 0)
    if len(filled):   # empty rows hold no ids, so the segment from one filled start to the next is one row's
        base = offsets[filled[0]]
        ids = flat[base: offsets[-1]]
        lowest[filled] = np.minimum.reduceat(ids, offsets[filled] - base)
        highest[filled] = np.maximum.reduceat(ids, offsets[filled] - base)
    return PromptBounds(lengths, lowest, highest)


@dataclass(frozen=True)
class RequestChecks:
    """The engine's limits a request is checked against (``grammars`` compiles constraints: their
    errors surface here, before the request is queued)."""

    vocab_size: int
    max_seq_len: int
    has_tokenizer: bool
    grammars: SlotGrammars

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the problem if this prompt/params pair cannot be generated."""
        ids = np.asarray(prompt_token_ids)
        if not len(ids):
            return self._check(0, 0, 0, params)
        if ids.dtype.kind not in "iu":   # not ids at all: reported as out of range, after the params' type
            return self._check(len(ids), -1, -1, params)
        self._check(len(ids), int(ids.min()), int(ids.max()), params)

    def problems(self, token_ids: np.ndarray, offsets: np.ndarray, params: Sequence[SamplingParams]
                 ) -> list[str | None]:
        """:meth:`check` for every row of the flat layout → each row's message, or None."""
        bounds = prompt_bounds(token_ids, offsets)
        return [self._problem(n, lo, hi, p) for n, lo, hi, p in
                zip(bounds.lengths.tolist(), bounds.lowest.tolist(), bounds.highest.tolist(), params)]

    def _problem(self, length: int, lowest: int, highest: int, params: SamplingParams) -> str | None:
        try:
            self._check(length, lowest, highest, params)
        except ValueError as e:
            return str(e)
        return None

    def _check(self, length: int, lowest: int, highest: int, params: SamplingParams) -> None:
        """THE rule, from a prompt's length and id range."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if length == 0:
            raise ValueError("prompt is empty (0 tokens)")
        if lowest < 0 or highest >= self.vocab_size:
            raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size})")
        if length >= self.max_seq_len:
            raise ValueError(f"prompt has {length} tokens; the context limit max_seq_len={self.max_seq_len} "
                             "leaves no room to generate")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"SamplingParams.logprobs={params.logprobs} exceeds the vocabulary "
                             f"({self.vocab_size} tokens)")
        # Ids the device indexes the vocabulary with (a stop id masked by min_tokens, a biased token).
        for field, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias])):
            if any(t >= self.vocab_size for t in ids):
                raise ValueError(f"SamplingParams.{field} token ids must be < the vocabulary size {self.vocab_size}, "
                                 f"got {max(ids)}")
        if params.stop and not self.has_tokenizer:
            raise ValueError("SamplingParams.stop needs a tokenizer: build the engine with OrthrusEngine(..., tokenizer=...)")
        if params.structured is not None:
            self.grammars.matcher(params.structured)    # compiles it (once per constraint): errors now
