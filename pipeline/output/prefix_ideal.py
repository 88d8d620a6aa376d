"""The ideal prefill of a run: each prompt's tokens minus the whole cache pages it shares with its
predecessor in the globally sorted order, summed over the run's rows.

Why this is the ideal: sorted, each prompt's longest shared prefix with any other is the one with
its predecessor, and the sum over rows of (pages a prompt could share) minus (pages it shares with
its predecessor) is the number of distinct page-aligned prefixes. So

    ideal = sum(prompt tokens) - page * (sum(shareable pages) - distinct page-aligned prefixes)

with a prompt's shareable pages ``(len - 1) // page`` (the engine always computes a prompt's last
token, so a page holding it is never shared: ``orthrus``'s admission does the same). The sums are
exact (of the committed rows); the distinct count is a HyperLogLog sketch (``REGISTERS`` registers,
about 1.6% error on the count, merged by register-wise max: a row sketched twice counts once), so
it costs a window's prepare task about a millisecond and a part's footer a few kilobytes, however
many rows the run has. Kept for both page sizes the engine uses (:data:`PAGES`).

A yardstick, not a lower bound: the engine also copies the partial page past the last whole one
from a row still running the same prefix, so a globally sorted run computes 0.82-0.97x this figure
(``python -m jobs.bench prefix_grouping``).
"""
from __future__ import annotations

import base64
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

PAGES = (16, 256)            # the engine's page sizes: SDPA and the CPU, FlashAttention
_P = 12
REGISTERS = 1 << _P
SKETCH = "__prefix_sketch"   # prepare -> driver: a window's registers per page size, on its first row
SKETCH_TYPE = pa.struct([pa.field(f"pages_{page}", pa.binary()) for page in PAGES])
_U = np.uint64
_MUL = (np.random.default_rng(0x0A7A).integers(1, 2 ** 63, 256, dtype=np.int64).astype(_U) << _U(1)) | _U(1)


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit finalizer (splitmix64): every input bit reaches every output bit."""
    x = x ^ (x >> _U(30))
    x = x * _U(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U(27))
    x = x * _U(0x94D049BB133111EB)
    return x ^ (x >> _U(31))


def node_hashes(prompts: pa.ListArray, page: int) -> np.ndarray:
    """One 64-bit hash per shareable page-aligned prefix of each non-null prompt ``[sum((len-1)//page)]``."""
    valid = prompts.is_valid().to_numpy(zero_copy_only=False)
    offsets = prompts.offsets.to_numpy().astype(np.int64)
    lengths = np.diff(offsets)
    pages = np.where(valid & (lengths > 1), (lengths - 1) // page, 0)                  # [R]
    total = int(pages.sum())
    if not total:
        return np.zeros(0, _U)
    flat = np.asarray(prompts.values.to_numpy(zero_copy_only=False), dtype=np.int64).astype(_U)
    first = np.cumsum(pages) - pages                                                     # [R] first node index
    j = np.arange(total, dtype=np.int64) - np.repeat(first, pages)                       # [N] page index in its row
    starts = np.repeat(offsets[:-1], pages) + j * page                                   # [N]
    tokens = flat[starts[:, None] + np.arange(page)]                                     # [N, page]
    salted = _mix((tokens * _MUL[:page]).sum(axis=1) ^ (j.astype(_U) * _U(0x9E3779B97F4A7C15)))
    running = np.cumsum(salted)                                                          # wraps: a sum mod 2^64
    before = np.repeat(np.concatenate([[_U(0)], running])[first], pages)                 # the row's sum before it
    return _mix((running - before) ^ _U(0xD6E8FEB86659FD93))


def registers(hashes: np.ndarray) -> np.ndarray:
    """HyperLogLog registers ``[REGISTERS] uint8`` of some hashes."""
    out = np.zeros(REGISTERS, np.uint8)
    if len(hashes):
        index = (hashes >> _U(64 - _P)).astype(np.int64)
        rest = (hashes << _U(_P)) | _U(1 << (_P - 1))          # a sentinel bit bounds the rank
        rank = 64 - np.floor(np.log2(rest.astype(np.float64))).astype(np.int64)
        np.maximum.at(out, index, rank.astype(np.uint8))
    return out


def distinct(regs: np.ndarray) -> float:
    """The HyperLogLog estimate of the distinct hashes behind ``regs`` (linear counting when small)."""
    m = REGISTERS
    zeros = int((regs == 0).sum())
    estimate = 0.7213 / (1 + 1.079 / m) * m * m / float(np.sum(np.ldexp(1.0, -regs.astype(np.int64))))
    return m * math.log(m / zeros) if zeros and estimate <= 2.5 * m else estimate


def window_sketch(prompts: pa.ListArray) -> dict[str, bytes]:
    """A window's sketch record (:data:`SKETCH_TYPE`)."""
    return {f"pages_{page}": registers(node_hashes(prompts, page)).tobytes() for page in PAGES}


def with_sketch(table: pa.Table, prompts: pa.ListArray) -> pa.Table:
    """``table`` with the window's sketch on its first row (the driver reads the few non-null ones)."""
    n = table.num_rows
    rows = ([window_sketch(prompts)] + [None] * (n - 1)) if n else []
    return table.append_column(pa.field(SKETCH, SKETCH_TYPE), pa.array(rows, SKETCH_TYPE))


def of_block(block: pa.Table) -> dict | None:
    """A committed block's share of the ideal: its generated rows' prompt tokens and shareable pages
    (exact sums), and the registers of the windows whose sketch it carries (None: no sketch column)."""
    if SKETCH not in block.column_names:
        return None
    ok = block.filter(pc.is_null(block["error"])) if "error" in block.column_names else block
    lengths = ok["num_input_tokens"].to_numpy().astype(np.int64) if ok.num_rows else np.zeros(0, np.int64)
    out: dict = {"prompt_tokens": int(lengths.sum())}
    for page in PAGES:
        out[f"shareable_pages_{page}"] = int(((lengths - 1) // page).clip(min=0).sum())
        sketches = pc.struct_field(block[SKETCH], f"pages_{page}").drop_null().to_pylist()
        if sketches:    # most blocks carry none (one per window): no registers to encode and merge
            regs = np.maximum.reduce([np.frombuffer(raw, np.uint8) for raw in sketches])
            out[f"sketch_{page}"] = base64.b64encode(regs.tobytes()).decode()
    return out


def merge(a: dict | None, b: dict | None) -> dict | None:
    """Two shares: sums add, registers keep the larger."""
    if a is None or b is None:
        return a or b
    out = {}
    for key in a.keys() | b.keys():
        x, y = a.get(key), b.get(key)
        if key.startswith("sketch_") and x is not None and y is not None:
            regs = np.maximum(np.frombuffer(base64.b64decode(x), np.uint8), np.frombuffer(base64.b64decode(y), np.uint8))
            out[key] = base64.b64encode(regs.tobytes()).decode()
        else:
            out[key] = x if y is None else y if x is None else x + y
    return out


def ideal_computed_tokens(share: dict | None, page: int | None) -> int | None:
    """The run's ideal prefill for the engine's page size (None: unknown, or a page size not sketched)."""
    if share is None or page not in PAGES or f"sketch_{page}" not in share:
        return None
    found = distinct(np.frombuffer(base64.b64decode(share[f"sketch_{page}"]), np.uint8))
    shared = max(0, share[f"shareable_pages_{page}"] - min(round(found), share[f"shareable_pages_{page}"]))
    return share["prompt_tokens"] - page * shared


def exact_ideal(prompts: list[list[int]], page: int) -> int:
    """The same figure computed exactly, by sorting (for tests and benchmarks: holds every prompt).
    A prompt shares a page with its predecessor only where both could share it (``(len - 1) // page``
    pages each), which is what counting distinct shareable prefixes amounts to."""
    ordered = sorted(prompts)
    total = 0
    for prev, cur in zip([None, *ordered], ordered):
        shared = 0
        if prev is not None:
            common, limit = 0, min(len(prev), len(cur))
            while common < limit and prev[common] == cur[common]:
                common += 1
            shared = min(common // page, (len(cur) - 1) // page, (len(prev) - 1) // page)
        total += len(cur) - page * shared
    return total
