"""The per-row settings: everything a request gives the slot it sits in, one row of a table each.

A row names the setting (the same name in :class:`~orthrus.engine.step.SlotParams`, on the device's
``SlotState`` and in the host's ``SlotTable`` mirror), its dtype and default (a free slot's value:
a row at it asks for nothing), how a request fills it, and the sampling path it turns on
(:class:`~orthrus.engine.step.SamplingPaths`): a forward whose rows all leave a setting at its
default skips that setting's work over the vocabulary, decided on the host. A ``ragged`` setting
holds a list per row (stop ids, logit-bias entries), padded with its default to the widest row.

Derived from the table: the admission's ``SlotParams`` (:func:`slot_params`, built once and read by
both sides), the device's per-slot tensors (allocation, reset, seat, widening), the host mirror
and the paths' flags. A new per-row option is a ``SamplingParams`` field, one row here, and the
kernel rule that reads it. Host side: numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Protocol

import numpy as np

from orthrus.engine.step import SamplingPaths, SlotParams
from orthrus.params import SamplingParams


class Request(Protocol):
    """What a setting is filled from: the engine's host record of a request (``host/requests.py``)."""

    params: SamplingParams
    seed: int
    think_at: int
    think_span: int
    stop_ids: tuple[int, ...]


@dataclass(frozen=True)
class RowSetting:
    """One per-row setting: ``name``, numpy ``dtype``, ``default`` (a free slot's value, asking for
    nothing), ``fill`` (the value of a request, a sequence for a ``ragged`` one), and the
    ``SamplingPaths`` flag a row away from the default turns on (None: no path of its own)."""

    name: str
    dtype: type
    default: int | float | bool
    fill: Callable[[Request], Any]
    path: str | None = None
    ragged: bool = False


def _sampled(value: Callable[[Request], Any], neutral: Any) -> Callable[[Request], Any]:
    """A setting that only a sampled row uses: a greedy row takes the neutral value, so it turns
    no path on (a greedy row's top-k, top-p or min-p changes nothing: the argmax always stays)."""
    return lambda r: neutral if r.params.greedy else value(r)


SETTINGS: tuple[RowSetting, ...] = (
    RowSetting("seed", np.int64, 0, lambda r: r.seed),
    RowSetting("max_new", np.int64, 0, lambda r: r.params.max_new_tokens),
    RowSetting("min_new", np.int64, 0, lambda r: r.params.min_tokens),
    RowSetting("think_at", np.int64, -1, lambda r: r.think_at),
    RowSetting("think_span", np.int64, 0, lambda r: r.think_span),
    RowSetting("greedy", np.bool_, False, lambda r: r.params.greedy),
    RowSetting("temperature", np.float64, 0.0, lambda r: r.params.temperature),
    RowSetting("top_k", np.int64, 0, _sampled(lambda r: r.params.top_k, 0), "filtered"),
    RowSetting("top_p", np.float64, 1.0, _sampled(lambda r: r.params.top_p, 1.0), "filtered"),
    RowSetting("min_p", np.float64, 0.0, _sampled(lambda r: r.params.min_p, 0.0), "min_p"),
    RowSetting("repetition_penalty", np.float64, 1.0, lambda r: r.params.repetition_penalty, "penalties"),
    RowSetting("presence_penalty", np.float64, 0.0, lambda r: r.params.presence_penalty, "penalties"),
    RowSetting("frequency_penalty", np.float64, 0.0, lambda r: r.params.frequency_penalty, "penalties"),
    # EOS (unless ignore_eos) and the row's own stop ids, ascending (sampling.forbid_early_stops)
    RowSetting("stop_ids", np.int64, -1, lambda r: r.stop_ids, ragged=True),
    RowSetting("bias_ids", np.int64, -1, lambda r: tuple(t for t, _ in r.params.logit_bias), "bias", ragged=True),
    RowSetting("bias_values", np.float64, 0.0, lambda r: tuple(b for _, b in r.params.logit_bias), ragged=True),
)
BY_NAME = {s.name: s for s in SETTINGS}
RAGGED = tuple(s.name for s in SETTINGS if s.ragged)
_PATH_FLAGS = {f.name for f in fields(SamplingPaths)}
assert all(s.path in _PATH_FLAGS for s in SETTINGS if s.path), "a setting's path is a SamplingPaths flag"


def slot_params(reqs: list[Request]) -> SlotParams:
    """The requests' settings as ``[n]`` arrays (``[n, S]`` for ragged ones, S the widest row's)."""
    values = {}
    for s in SETTINGS:
        if not s.ragged:
            values[s.name] = np.asarray([s.fill(r) for r in reqs], dtype=s.dtype)
            continue
        rows = [s.fill(r) for r in reqs]
        out = np.full((len(reqs), max(map(len, rows), default=0)), s.default, dtype=s.dtype)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        values[s.name] = out
    return SlotParams(values)


def seen_prompts(slots: np.ndarray, prompts: list[np.ndarray], params: SlotParams
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For an admission's rows in ``slots``: the slots of rows with a penalty (their counts start
    from zero), and the prompt tokens of those with a repetition penalty, flat, with each token's
    slot (a repetition penalty counts the prompt as seen). Bounded by the penalised rows' prompts."""
    penalized = asks(params, "repetition_penalty") | asks(params, "presence_penalty") | asks(params, "frequency_penalty")
    rep = np.flatnonzero(asks(params, "repetition_penalty"))
    tokens = np.concatenate([prompts[i] for i in rep]) if len(rep) else np.zeros(0, dtype=np.int64)
    owner = np.repeat(slots[rep], [len(prompts[i]) for i in rep]) if len(rep) else np.zeros(0, dtype=np.int64)
    return slots[penalized], owner.astype(np.int64), tokens.astype(np.int64)


def asks(params: SlotParams, name: str) -> np.ndarray:
    """``[n]`` bool: the rows whose ``name`` setting is away from its default (asks for something)."""
    s, v = BY_NAME[name], params[name]
    off = v != s.default
    return off.any(1) if s.ragged else off


class HostSettings:
    """The host's mirror of every slot's settings, ``[B]`` per setting that is not ragged, and
    ``[B]`` bool per setting with a sampling path: whether the row asks for it (:func:`asks`, the
    one rule), from which each forward's sampling paths are read."""

    def __init__(self, num_slots: int) -> None:
        self.values = {s.name: np.full(num_slots, s.default, dtype=s.dtype) for s in SETTINGS if not s.ragged}
        self.asking = {s.name: np.zeros(num_slots, dtype=bool) for s in SETTINGS if s.path is not None}

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[name]

    def admit(self, slots: np.ndarray, params: SlotParams) -> None:
        """Seat ``params``' rows in ``slots``."""
        for name, mirror in self.values.items():
            mirror[slots] = params[name]
        for name, mirror in self.asking.items():
            mirror[slots] = asks(params, name)

    def paths(self, slots: np.ndarray) -> dict[str, bool]:
        """Each path flag of the table: whether some row of ``slots`` asks for a setting on it."""
        on = dict.fromkeys((BY_NAME[name].path for name in self.asking), False)
        for name, mirror in self.asking.items():
            on[BY_NAME[name].path] |= bool(mirror[slots].any())
        return on
