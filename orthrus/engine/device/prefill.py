"""Device side of prefill: prompt chunks in the step's one AR forward, through the prefix cache.

A seated row's shared prefix pages are in its page table before the step starts (by reference:
nothing to copy); its seat step then copies what a running slot holds of its prompt (a partial
page; for an identical prompt, the last hidden state too, and nothing is computed). The rest of its
tokens are computed in chunks (``host/prefilling.py``), each step's chunks riding in that step's
one AR forward after the iteration's block: one flat token batch (``model/ragged.py``), row i
computing tokens ``start[i] … start[i] + len[i] - 1`` at their own positions, attended in groups of
rows of similar length. When a new row's last chunk is computed, its last hidden state is kept
(``SlotState.prompt_hidden``) and its first token is sampled from it (``kernels.sample_first``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from orthrus.engine.device.verify_budget import VerifyLayout
from orthrus.model.backends import AttentionBackend, BlockBatch
from orthrus.model.cache import PagedKVCache
from orthrus.model.qwen3 import OrthrusForCausalLM
from orthrus.model.ragged import AttentionGroup, RaggedBatch


@dataclass(frozen=True)
class PrefixCopy:
    """KV pages ``src [c]`` into pages ``dst [c]``; for rows whose whole prompt a running slot
    holds, its last hidden state too (slots ``hidden_src [w]`` → ``hidden_dst [w]``)."""

    src: torch.Tensor
    dst: torch.Tensor
    hidden_src: torch.Tensor
    hidden_dst: torch.Tensor

    def apply(self, cache: PagedKVCache, hidden: torch.Tensor) -> None:
        """Copy the pages in every layer and the hidden states ``hidden [B, E]``."""
        cache.copy_pages(self.src, self.dst)
        hidden[self.hidden_dst] = hidden[self.hidden_src]


@dataclass(frozen=True)
class ChunkForward:
    """A step's prompt chunks on the device: ``tokens [P]`` at ``positions [P]``, attended in
    ``groups`` (``first`` counted from the chunks' first token); ``slots [h]``: rows whose chunk ends
    a new row's prompt, ``last [h]`` the index of that chunk's last token."""

    tokens: torch.Tensor
    positions: torch.Tensor
    groups: tuple[AttentionGroup, ...]
    slots: torch.Tensor
    last: torch.Tensor


def ar_forward(model: OrthrusForCausalLM, cache: PagedKVCache, backend: AttentionBackend, hidden: torch.Tensor,
               block: torch.Tensor | None, view: BlockBatch | None, chunk: ChunkForward | None,
               layout: VerifyLayout | None = None) -> torch.Tensor | None:
    """ONE AR-view forward over an iteration's ``block [b, T]`` (at ``view``; with a verify
    ``layout``, only its verified cells) and a step's prompt ``chunk`` after it (either may be None)
    → the block's hidden ``[b, T, E]`` (``[N, E]`` flat with a layout; None without a block); a
    completed prompt's last hidden state goes to ``hidden [B, E]``."""
    if chunk is None and layout is None:
        return model.forward_cached(block, cache, view, diffusion=False, backend=backend)
    groups, tokens, positions, n = [], [], [], 0
    if block is not None:
        tok, pos = block.reshape(-1), view.positions.reshape(-1)             # [b*T]
        take = put = None
        if layout is not None:                                               # [N]: the verified cells
            tok, pos, take, put = layout.flat(block), layout.flat(view.positions), layout.take, layout.put
        n = tok.shape[0]
        groups.append(AttentionGroup(view.slot_index(cache.num_slots), view.positions, 0, n, view.kv_len, take, put))
        tokens.append(tok)
        positions.append(pos)
    if chunk is not None:
        groups += [replace(g, first=g.first + n) for g in chunk.groups]
        tokens.append(chunk.tokens)
        positions.append(chunk.positions)
    batch = RaggedBatch(torch.cat(positions) if len(positions) > 1 else positions[0], tuple(groups))
    out = model.forward_ragged(torch.cat(tokens) if len(tokens) > 1 else tokens[0], cache, batch,
                               diffusion=False, backend=backend)             # [n + P, E]
    if chunk is not None:
        hidden[chunk.slots] = out.index_select(0, chunk.last + n)              # [h, E]
    if block is None:
        return None
    return out[:n] if layout is not None else out[:n].view(*block.shape, -1)  # [N, E] | [b, T, E]
