"""Per-slot decoding state on the device, ``[B]`` tensors allocated once per engine."""
from __future__ import annotations

import torch

from orthrus.params import MAX_LOGPROBS
from orthrus.sampling import SamplingTensors
from orthrus.engine.step import SamplingPaths


class SlotState:
    """Per-slot decoding state on the device, ``[B]`` (``stop_ids [B, S]``, padded with -1)."""

    def __init__(self, num_slots: int, stop_width: int, device: torch.device, hidden_size: int = 1,
                 dtype: torch.dtype = torch.float32, forced_thinking: tuple[int, ...] = ()) -> None:
        # Allocated once per engine: captured CUDA graphs hold these addresses (graphs.py).
        def z(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(num_slots, dtype=dtype, device=device)
        self.anchor, self.seed, self.counter = z(torch.long), z(torch.long), z(torch.long)
        self.out_count, self.max_new, self.min_new, self.prompt_len = z(torch.long), z(torch.long), z(torch.long), z(torch.long)
        self.reason, self.first = z(torch.long), z(torch.long) - 1
        self.top_k, self.temperature, self.top_p = z(torch.long), z(torch.float64), z(torch.float64) + 1
        self.greedy, self.alive = z(torch.bool), z(torch.bool)
        # Thinking budgets: the generated index where a row's spent budget forces the think end (-1:
        # none, or its phase ended earlier), how many tokens it forces, and which (the think end, then
        # the chat template's separator; sampling.force_reasoning_end).
        self.think_at, self.think_span = z(torch.long) - 1, z(torch.long)
        self.forced_thinking = torch.tensor(forced_thinking or (0,), dtype=torch.long, device=device)
        self.stop_ids = torch.full((num_slots, max(stop_width, 1)), -1, dtype=torch.long, device=device)
        # [B, E] the final hidden state at the prompt's last position: with the prompt's K/V (cache
        # positions < prompt_len, never overwritten while the row runs) it lets a later request with
        # the same prompt start from this slot's prefill instead of computing its own.
        self.prompt_hidden = torch.zeros((num_slots, hidden_size), dtype=dtype, device=device)
        # The first token's logprobs, from the prefill's logits, until the row's first iteration packs them.
        self.first_lp = z(torch.float64)
        self.first_top_lp = torch.zeros((num_slots, MAX_LOGPROBS), dtype=torch.float64, device=device)
        self.first_top_id = torch.zeros((num_slots, MAX_LOGPROBS), dtype=torch.long, device=device)

    def widen(self, stop_width: int) -> None:
        """Room for ``stop_width`` stop ids per slot, keeping every slot's current ones."""
        old = self.stop_ids
        if stop_width <= old.shape[1]:
            return
        self.stop_ids = torch.full((old.shape[0], stop_width), -1, dtype=torch.long, device=old.device)
        self.stop_ids[:, : old.shape[1]] = old

    def reset(self) -> None:
        """Every slot empty and dead, in place (a prefill sets all of a slot's fields)."""
        for t in (self.anchor, self.seed, self.counter, self.out_count, self.max_new, self.min_new, self.think_span,
                  self.prompt_len, self.reason, self.top_k, self.temperature, self.greedy, self.alive):
            t.zero_()
        self.first.fill_(-1)
        self.think_at.fill_(-1)
        self.top_p.fill_(1)
        self.stop_ids.fill_(-1)

    def sampling(self, slots: torch.Tensor, paths: SamplingPaths) -> SamplingTensors:
        """Processing parameters of the given slots (the paths are host-known, never read back)."""
        return SamplingTensors(self.temperature[slots], self.top_k[slots], self.top_p[slots],
                               self.greedy[slots], paths.filtered, paths.all_greedy)
