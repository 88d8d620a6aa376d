"""Device side of admission: the prompts' K/V and last hidden states, through the prefix cache.

A row's shared prefix pages are in its page table before the step starts (by reference: nothing
to copy); an admitting step then runs one or two *stages*, each a device copy then ragged forwards:

    stage 1   copy partial pages from running slots whose prompts the new rows extend, then one
              flat forward over every row that has something to compute: a prompt nobody holds
              (from position 0), the rest of a prompt whose prefix is shared, or a preempted row's
              prompt and committed tokens (recomputed)
    stage 2   the same for rows sharing a prefix with a row stage 1 just computed (rows admitted
              together that share a prefix: the first computes it, the others share it)

A row whose whole prompt a running slot holds copies that slot's last hidden state too and computes
nothing. Every forward is flat (``model/ragged.py``): row i computes tokens ``start[i] … start[i] +
len[i] - 1`` at their own positions and no pad token reaches a linear layer; attention runs per
group of rows of similar length, planned on the host (``host/admission.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from orthrus.model.backends import AttentionBackend
from orthrus.model.cache import PagedKVCache
from orthrus.model.qwen3 import OrthrusForCausalLM
from orthrus.model.ragged import RaggedBatch


@dataclass(frozen=True)
class PrefixCopy:
    """KV pages ``src [c]`` into pages ``dst [c]``; for rows whose whole prompt a running slot
    holds, its last hidden state too (slots ``hidden_src [w]`` → ``hidden_dst [w]``)."""

    src: torch.Tensor
    dst: torch.Tensor
    hidden_src: torch.Tensor
    hidden_dst: torch.Tensor


@dataclass(frozen=True)
class RestForward:
    """One flat prefill forward: ``tokens [N]`` (the rows' rests back to back) laid out by ``batch``;
    ``slots [u]`` the rows and ``last [u]`` the flat index of each row's last token."""

    tokens: torch.Tensor
    batch: RaggedBatch
    slots: torch.Tensor
    last: torch.Tensor


@dataclass(frozen=True)
class PrefillStage:
    """A copy (None: nothing to copy) followed by at most one flat forward."""

    copy: PrefixCopy | None
    forward: RestForward | None


@dataclass(frozen=True)
class PrefillBatch:
    """Rows admitted in one step, on the device (host-planned by ``host/admission.py``):
    ``slots [b]``, their prompt lengths ``row_lens [b]``, the stages that fill their prompts (and
    recompute preempted rows' K/V), and the grammar masks of their first tokens ``masks [b, W]``
    int32 (None: no row is constrained)."""

    slots: torch.Tensor
    row_lens: torch.Tensor
    stages: tuple[PrefillStage, ...]
    masks: torch.Tensor | None = None


def prompt_states(model: OrthrusForCausalLM, cache: PagedKVCache, backend: AttentionBackend, hidden: torch.Tensor,
                  stages: tuple[PrefillStage, ...]) -> None:
    """Fill every admitted slot's prompt K/V and ``hidden [B, E]`` (last prompt position), stage by stage."""
    for stage in stages:
        c = stage.copy
        if c is not None:
            cache.copy_pages(c.src, c.dst)
            hidden[c.hidden_dst] = hidden[c.hidden_src]
        f = stage.forward
        if f is not None:
            out = model.forward_ragged(f.tokens, cache, f.batch, diffusion=False, backend=backend)   # [N, E]
            hidden[f.slots] = out.index_select(0, f.last)
