"""Per-token log-probabilities, device side: gathered here, carried by the iteration's one host read
(its layout: ``packed.py``), kept on the host (``host/logprob_book.py``).

Values are the log-softmax of the AR (target) view's *raw* logits (before temperature, top-k and
top-p) at each generated position: what plain AR decoding of the same tokens reports, whatever the
drafts were. A speculative cycle's verify forward has the AR logits of every block position, so
accepted drafts and the corrected/bonus token all read theirs there; an AR step reads its one
position; a row's first token reads the prefill's logits, kept in ``SlotState`` until the row's
first iteration packs it (the prefill itself reads nothing back).

Cost: an iteration computes logprobs only when a row in it asked (``LogprobBook.width``, host-known
like the sampling fast paths); then its packed int64 result grows by a block (``block``) of float64
bit patterns and token ids, in the same single transfer.
"""
from __future__ import annotations

import torch

from orthrus.engine.device.slot_state import SlotState


def gather(logits: torch.Tensor, tokens: torch.Tensor, width: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw logits ``[b, T, V]`` and tokens ``[b, T]`` → token logprobs ``[b, T]``, top ``width``
    logprobs ``[b, T, w]`` (descending) and their ids ``[b, T, w]``; float32 at least (float64 for a
    float64 model)."""
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lsm = logits.to(work).log_softmax(-1)                                     # [b, T, V]
    lp = lsm.gather(-1, tokens[..., None]).squeeze(-1)                        # [b, T]
    if width == 0:
        return lp, lsm[..., :0], tokens[..., None][..., :0]
    top_lp, top_id = lsm.topk(width, -1)                                      # [b, T, w]
    return lp, top_lp, top_id


def store_first(st: SlotState, slots: torch.Tensor, logits: torch.Tensor, first: torch.Tensor, width: int) -> None:
    """Keep the first tokens' logprobs (prefill logits ``[b, 1, V]``, tokens ``first [b]``) in the
    slots' state until their first iteration packs them."""
    lp, top_lp, top_id = gather(logits, first[:, None], width)
    st.first_lp[slots] = lp[:, 0].to(torch.float64)
    if width:
        st.first_top_lp[slots, :width] = top_lp[:, 0].to(torch.float64)
        st.first_top_id[slots, :width] = top_id[:, 0]


def block(st: SlotState, slots: torch.Tensor, logits: torch.Tensor, emitted: torch.Tensor,
          width: int) -> torch.Tensor:
    """One iteration's logprob block ``[b, (1 + W) * (1 + 2w)]`` int64: the stored first token,
    then the emitted tokens ``[b, W]`` scored by their AR logits ``[b, W, V]``."""
    return _assemble(st, slots, *gather(logits, emitted, width), width)


def first_block(st: SlotState, slots: torch.Tensor, positions: int, width: int) -> torch.Tensor:
    """The block of rows that emit nothing this iteration (complete after their prefill): the stored
    first token, then ``positions`` empty positions."""
    b = slots.shape[0]
    lp = torch.zeros((b, positions), dtype=torch.float64, device=slots.device)
    top_id = torch.zeros((b, positions, width), dtype=torch.long, device=slots.device)
    return _assemble(st, slots, lp, lp[..., None].expand(b, positions, width), top_id, width)


def _assemble(st: SlotState, slots: torch.Tensor, lp: torch.Tensor, top_lp: torch.Tensor, top_id: torch.Tensor,
              width: int) -> torch.Tensor:
    lp = torch.cat([st.first_lp[slots][:, None], lp.to(torch.float64)], 1)                       # [b, 1+W]
    top_lp = torch.cat([st.first_top_lp[slots][:, None, :width], top_lp.to(torch.float64)], 1)  # [b, 1+W, w]
    top_id = torch.cat([st.first_top_id[slots][:, None, :width], top_id], 1)                    # [b, 1+W, w]
    floats = torch.cat([lp[..., None], top_lp], -1).view(torch.int64)                           # [b, 1+W, 1+w]
    return torch.cat([floats, top_id], -1).flatten(1)
