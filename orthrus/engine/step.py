"""The records of the engine's host/device seam, one step at a time (numpy only, no torch):

    Scheduler.schedule() -> ScheduledStep -> ModelRunner.execute(step) -> StepOutput
                                          -> Scheduler.update(step, output) -> list[RequestOutput]

A :class:`ScheduledStep` is everything the device does in one step, decided on the host: slots to
mark dead first, an :class:`Admission` (new requests, their sampling parameters and what running
slots hold of their prompts), an :class:`Iteration` (one speculative cycle or AR step over the live
rows), :class:`PrefillWork` (prompt chunks computed in the iteration's AR forward, within the
step's token budget) and the rows that only need packing. Shapes: ``n`` rows.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from orthrus.engine.packed import Packed

AR = 0   # block size of a plain AR step


def verify_budget(eighths: int | None, rows: int, block: int) -> int | None:
    """``eighths``/8 of the drafts of ``rows`` rows of a ``block`` cycle, at least one (None: all)."""
    if eighths is None or eighths >= 8 or block == AR:
        return None
    return max(1, -(-rows * (block - 1) * eighths // 8))


def occupancy_bucket(n: int) -> int:
    """The next power of two of ``n`` (at least 1): the speculation policy's occupancy bucket and a
    static iteration's padded row count, the same numbers so that what the policy measures at a
    bucket is the work a static iteration does there."""
    return 1 << max(0, (max(n, 1) - 1).bit_length())


@dataclass(frozen=True)
class SamplingPaths:
    """The sampling work a forward's rows need beyond the plain draw (host-known, part of a CUDA
    graph's key): a flag off skips that work over the vocabulary for every row. The flags a per-row
    setting turns on are named in ``row_settings.SETTINGS``."""

    filtered: bool      # some row samples with top-k or top-p
    all_greedy: bool    # every row decodes by argmax
    min_tokens: bool = False   # some row may not stop yet (its min_tokens): mask its stop ids
    thinking: bool = False     # some row's thinking budget may force tokens: track its think end
    min_p: bool = False        # some row samples with min_p
    penalties: bool = False    # some row has a repetition, presence or frequency penalty
    bias: bool = False         # some row has a logit bias


@dataclass(frozen=True)
class SlotParams:
    """Admitted rows' per-row settings by their ``row_settings`` names: ``[n]`` arrays, ``[n, S]``
    for a ragged one (padded with its default)."""

    values: Mapping[str, np.ndarray]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[name]


@dataclass(frozen=True)
class PromptCopy:
    """From running slot ``src`` to slot ``dst``: copy KV page ``src_page`` into ``dst_page`` (a
    shared prompt's partial page; -1: none) and, when ``whole`` (``src`` runs this very prompt), the
    last prompt position's hidden state."""

    src: int
    dst: int
    src_page: int
    dst_page: int
    whole: bool


@dataclass(frozen=True)
class PromptChunk:
    """Compute ``rest`` (a row's tokens from position ``start``: its prompt, or a preempted row's
    prompt and committed tokens) into ``slot`` this step; ``last``: the chunk ends a new row's prompt,
    so its last hidden state is kept and the row's first token is sampled from it."""

    slot: int
    start: int
    rest: np.ndarray
    last: bool = False
    after: int = -1     # a row whose prompt this one shares, computed before it (its group comes first)


@dataclass(frozen=True)
class Admission:
    """Requests seated in ``slots [n]`` this step: prompt lengths and parameters, and the ``copies``
    that give them what running slots hold of their prompts (a partial page, a whole prompt's last
    hidden state). Their K/V is then computed in chunks (:class:`PrefillWork`), this step and later
    ones. ``resumed``: rows preempted for want of pages, seated again (their device state was kept;
    their K/V is recomputed the same way, nothing is sampled for them)."""

    slots: np.ndarray
    prompt_lens: np.ndarray
    params: SlotParams
    copies: tuple[PromptCopy, ...]
    resumed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # Rows with penalties (their token counts start from zero) and, for those with a repetition
    # penalty, their prompts' tokens (``seen_tokens``, each at its slot ``seen_slots``).
    penalized: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    seen_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    seen_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass(frozen=True)
class PrefillWork:
    """A step's prompt chunks, computed in its one AR forward after the iteration's block and laid
    out in attention ``groups`` of rows of similar length (``model/ragged.py``), and the new rows
    whose prompts are complete after it: ``done [d]`` (prompt lengths ``done_lens``; ``copies`` give
    rows whose whole prompt a row completing here holds its partial page and hidden state), whose first
    token is sampled from their prompt's last hidden state (``paths``; grammar masks ``first_masks
    [d, W]`` or None; the logprob width ``logprobs``, None: no row asked)."""

    groups: tuple[tuple[PromptChunk, ...], ...]
    done: np.ndarray
    done_lens: np.ndarray
    first_masks: np.ndarray | None
    paths: SamplingPaths
    logprobs: int | None
    copies: tuple[PromptCopy, ...] = ()
    # Runs ahead of the iteration in a forward of its own, and the iteration's rows are rows it
    # completes (an idle engine: they take their first cycle in the same step); else it rides in
    # the iteration's AR forward and its completed rows start in the next step.
    ahead: bool = False

    @property
    def tokens(self) -> int:
        """Token positions the chunks compute."""
        return sum(len(c.rest) for g in self.groups for c in g)


class DraftMasks(Protocol):
    """The host oracle of a constrained cycle's masks along its drafts (the grammar matchers)."""

    words: int

    def path(self, rows: np.ndarray, drafts: np.ndarray) -> np.ndarray:
        """Masks ``[n, K, W]`` int32 for the K verify positions of ``rows`` given ``drafts [n, K-1]``."""
        ...


@dataclass(frozen=True)
class Iteration:
    """One cycle of ``block`` (or an AR step, ``AR``) over the live rows ``slots [n]``.

    ``kv_len``: host-known bound on the keys a row can see. ``first_masks [n, W]`` and ``grammar``:
    only when some row is constrained. ``arm``: the block size the speculation policy measures with
    this iteration's time (None: a block the policy did not choose as is). ``verify_eighths``: the
    share of a cycle's drafts it verifies, where its drafter is most confident (None: every draft;
    the verify policy's arm, measured with this iteration's time)."""

    block: int
    slots: np.ndarray
    kv_len: int
    paths: SamplingPaths
    first_masks: np.ndarray | None = None
    grammar: DraftMasks | None = None
    arm: int | None = None
    verify_eighths: int | None = None

    def verify_budget(self, rows: int) -> int | None:
        """The drafts a cycle over ``rows`` rows (the padded count of a static iteration: what it
        computes, so a graph serves every occupancy of its bucket) verifies in all (None: all)."""
        return verify_budget(self.verify_eighths, rows, self.block)

    @property
    def width(self) -> int:
        """Emitted-token columns of its packed result."""
        return self.block if self.block != AR else 1


@dataclass(frozen=True)
class ScheduledStep:
    """Everything the device does in one step, in this order: ``pages`` (page-table changes ``[c, 3]``:
    slot, entry, page), ``kill`` (rows the host ended: aborted, a stop string, a failed grammar),
    ``admission`` (seat, copy), the ``iteration``'s draft, then ONE AR forward over the iteration's
    block and the ``prefill`` chunks, the iteration's acceptance and the completed prompts' first
    tokens, then pack ``settled`` (rows whose first token is new, or that sit the iteration out)
    beside the iteration's rows in the one read. ``logprobs``: the read's top-k width, the
    iteration's and the settled rows' (None: no row asked). ``paused``: rows that hold a slot but
    sit the step out, preempted or still prefilling (never a static iteration's padding)."""

    kill: np.ndarray
    admission: Admission | None
    iteration: Iteration | None
    settled: np.ndarray
    logprobs: int | None
    pages: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    paused: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    prefill: PrefillWork | None = None

    @property
    def reads(self) -> bool:
        """Whether the step reads anything back (an iteration, or rows to settle)."""
        return self.iteration is not None or len(self.settled) > 0

    @property
    def rows(self) -> np.ndarray:
        """The slots of the packed result's rows, in order: the iteration's, then the settled."""
        live = self.iteration.slots if self.iteration is not None else self.settled[:0]
        return np.concatenate([live, self.settled]) if len(self.settled) else live


@dataclass(frozen=True)
class StepOutput:
    """What one step read back: the packed rows of ``ScheduledStep.rows`` (None: nothing was read),
    when the iteration started (``time.perf_counter``), for the speculation policy, and the token
    positions its forwards computed (host-known shapes, padding included): ``prefill_slots`` in the
    prefill forwards, ``iteration_slots`` in the draft and verify forwards (or the AR step)."""

    packed: Packed | None
    started: float
    prefill_slots: int = 0
    iteration_slots: int = 0
    compile_ms: int = 0      # milliseconds this step spent compiling layer pieces (or loading them from disk)
