"""Per-slot decoding state on the device, ``[B]`` tensors allocated once per engine.

Shape legend: B slots, S a ragged setting's width (stop ids, logit-bias entries), V vocabulary,
E hidden size. The rows' settings are the table ``row_settings.SETTINGS`` (one tensor each, named
after it); the rest is what decoding keeps per slot (``DECODE_STATE``).
"""
from __future__ import annotations

import numpy as np
import torch

from orthrus.engine.row_settings import BY_NAME, SETTINGS
from orthrus.params import MAX_LOGPROBS
from orthrus.sampling import Penalties, SamplingTensors
from orthrus.engine.step import SamplingPaths

_TORCH = {np.int64: torch.long, np.float64: torch.float64, np.bool_: torch.bool}
# What decoding keeps per slot besides its settings: (name, dtype, a free slot's value). ``first``:
# a new row's first token until its first iteration packs it (-1: none).
DECODE_STATE = (("anchor", torch.long, 0), ("counter", torch.long, 0), ("out_count", torch.long, 0),
                ("prompt_len", torch.long, 0), ("reason", torch.long, 0), ("first", torch.long, -1),
                ("alive", torch.bool, False))


class SlotState:
    """Per-slot decoding state on the device: one ``[B]`` tensor per setting of the table (``[B, S]``
    for a ragged one, padded with its default) and per ``DECODE_STATE`` entry."""

    def __init__(self, num_slots: int, stop_width: int, device: torch.device, hidden_size: int = 1,
                 dtype: torch.dtype = torch.float32, forced_thinking: tuple[int, ...] = ()) -> None:
        # Allocated once per engine: captured CUDA graphs hold these addresses (graphs.py).
        self.num_slots, self.device = num_slots, device
        for s in SETTINGS:
            shape = (num_slots, max(stop_width if s.name == "stop_ids" else 1, 1)) if s.ragged else (num_slots,)
            setattr(self, s.name, torch.full(shape, s.default, dtype=_TORCH[s.dtype], device=device))
        for name, kind, value in DECODE_STATE:
            setattr(self, name, torch.full((num_slots,), value, dtype=kind, device=device))
        # The tokens a spent thinking budget forces (the think end, then the chat template's separator).
        self.forced_thinking = torch.tensor(forced_thinking or (0,), dtype=torch.long, device=device)
        # [B, E] the final hidden state at the prompt's last position: with the prompt's K/V (cache
        # positions < prompt_len, never overwritten while the row runs) it lets a later request with
        # the same prompt start from this slot's prefill instead of computing its own.
        self.prompt_hidden = torch.zeros((num_slots, hidden_size), dtype=dtype, device=device)
        # The first token's logprobs, from the prefill's logits, until the row's first iteration packs them.
        self.first_lp = torch.zeros(num_slots, dtype=torch.float64, device=device)
        self.first_top_lp = torch.zeros((num_slots, MAX_LOGPROBS), dtype=torch.float64, device=device)
        self.first_top_id = torch.zeros((num_slots, MAX_LOGPROBS), dtype=torch.long, device=device)
        # Penalised rows' token counts [B, V] (generated tokens) and prompt tokens seen [B, V]:
        # allocated by ``track_penalties`` when the first such row is seated, so an engine whose
        # rows have no penalties never holds them.
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None

    def widen(self, name: str, width: int) -> bool:
        """Room for ``width`` entries per slot in the ragged setting ``name``, keeping every slot's
        current ones → whether it grew (a captured graph holds the old buffer)."""
        old = getattr(self, name)
        if width <= old.shape[1]:
            return False
        new = torch.full((old.shape[0], width), BY_NAME[name].default, dtype=old.dtype, device=old.device)
        new[:, : old.shape[1]] = old
        setattr(self, name, new)
        return True

    def track_penalties(self, vocab_size: int) -> bool:
        """Allocate the penalty counts if they are not yet → whether they were (a graph must be
        captured again: its key changes with the paths anyway, but not its buffers')."""
        if self.counts is not None:
            return False
        self.counts = torch.zeros((self.num_slots, vocab_size), dtype=torch.int32, device=self.device)
        self.seen = torch.zeros((self.num_slots, vocab_size), dtype=torch.bool, device=self.device)
        return True

    def reset(self) -> None:
        """Every slot empty and dead, in place (a prefill sets all of a slot's fields)."""
        for s in SETTINGS:
            getattr(self, s.name).fill_(s.default)
        for name, _, value in DECODE_STATE:
            getattr(self, name).fill_(value)

    def sampling(self, slots: torch.Tensor, paths: SamplingPaths) -> SamplingTensors:
        """Processing parameters of the given slots (the paths are host-known, never read back)."""
        return SamplingTensors(self.temperature[slots], self.top_k[slots], self.top_p[slots],
                               self.greedy[slots], paths.filtered, paths.all_greedy,
                               self.min_p[slots] if paths.min_p else None)

    def penalties(self, slots: torch.Tensor, paths: SamplingPaths) -> Penalties | None:
        """The given slots' logit biases and penalties with their token counts (None: no row has any)."""
        if not (paths.penalties or paths.bias):
            return None
        bias = (self.bias_ids[slots], self.bias_values[slots]) if paths.bias else (None, None)
        counts = (self.counts[slots], self.seen[slots]) if paths.penalties else (None, None)   # seated: allocated
        return Penalties(*bias, *counts, self.repetition_penalty[slots], self.presence_penalty[slots],
                         self.frequency_penalty[slots])
