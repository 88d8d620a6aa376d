"""Reasoning models' thinking: the tokens that delimit it and where a request's reasoning phase starts.

Qwen3's chat template with thinking on opens the assistant turn and lets the model write
``<think>`` … ``</think>`` itself; with thinking off it writes an empty, closed think block into
the prompt. So a request is in its reasoning phase from its first generated token when its prompt
opens the assistant turn (or a think block) without closing a think block after it, and the phase
ends with the first think-end token the row generates. Host only: no torch here.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ReasoningTokens:
    """The ids that delimit thinking (Qwen3: ``<think>`` 151667, ``</think>`` 151668), the
    ``separator`` the chat template writes after the think end (Qwen3: "\\n\\n", one token), and the
    token that opens a chat turn (Qwen3: ``<|im_start|>``; None: prompts are not chat-templated)."""

    start: int
    end: int
    separator: tuple[int, ...] = ()
    turn_start: int | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ReasoningTokens | None:
        """The tokenizer's think tokens (None: it has none, so no request ever reasons)."""
        vocab = tokenizer.get_vocab()
        if "<think>" not in vocab or "</think>" not in vocab:
            return None
        separator = tuple(tokenizer.encode("\n\n", add_special_tokens=False))
        return cls(vocab["<think>"], vocab["</think>"], separator, vocab.get("<|im_start|>"))

    @property
    def forced(self) -> tuple[int, ...]:
        """What a thinking budget forces once it is spent: the think end, then the separator."""
        return (self.end, *self.separator)

    def opens_reasoning(self, prompt: Sequence[int]) -> bool:
        """Whether a request with this prompt starts in its reasoning phase: the prompt ends inside an
        open think block, or opens a chat turn after its last think end (the model writes the block)."""
        ids = np.asarray(prompt, dtype=np.int64)

        def last(token: int | None) -> int:
            hits = np.flatnonzero(ids == token) if token is not None else ()
            return int(hits[-1]) if len(hits) else -1
        end = last(self.end)
        return last(self.start) > end or last(self.turn_start) > end

    def reasoning_length(self, token_ids: Sequence[int]) -> int:
        """Generated tokens up to and including the first think end (all of them if it never came)."""
        hits = np.flatnonzero(np.asarray(token_ids, dtype=np.int64) == self.end)
        return int(hits[0]) + 1 if len(hits) else len(token_ids)
