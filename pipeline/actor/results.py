"""Engine results → the batch's generation columns, in one pass over the rows.

Which columns, and how each is taken from a row's ``RequestOutput``, is the table of columns'
(``pipeline/columns.py``: its ``engine`` rows); this module only makes that fast. Each finished row
is a Python object, so one pass per row is the floor: the row's plain attributes are read by one
``operator.attrgetter`` call (C, one tuple), the few computed columns by their functions, and the
rows are transposed into columns, instead of one list comprehension (and one attribute walk) per
column. At a token or a few per row (labelling and scoring jobs) this pass weighs as much as the
decoding, so it counts.
"""
from __future__ import annotations

from operator import attrgetter

from orthrus import RequestOutput, SamplingParams
from pipeline.columns import ENGINE
from pipeline.requests.errors import ERROR

# Plain attribute paths first, then the computed columns: ``_COLUMNS`` names the positions of the
# tuple ``_row`` makes, both derived here from the same rows, so they cannot drift apart.
_PLAIN = tuple(c for c in ENGINE if isinstance(c.take, str))
_COMPUTED = tuple(c for c in ENGINE if not isinstance(c.take, str))
_COLUMNS = tuple(c.name for c in (*_PLAIN, *_COMPUTED))
_TAKES = tuple(c.take for c in _COMPUTED)
_PATHS = tuple(c.take for c in _PLAIN)
# attrgetter of several paths returns a tuple, of one the value itself: a tuple either way here.
_get = attrgetter(*_PATHS) if len(_PATHS) > 1 else (lambda r: tuple(attrgetter(p)(r) for p in _PATHS))
_ERROR_ROW = (None,) * len(_COLUMNS)        # finish_reason and error: ``errors.finish_columns``


def result_columns(ok: list[RequestOutput | None], errors: list[str | None], params: list[SamplingParams | None],
                   eos_ids: frozenset[int]) -> dict[str, list]:
    """Per-row values of every engine column of the table (None for rows without a result), and
    ``errors`` as the ``error`` column; ``postprocess.detokenize_batch`` decides the rows' finish
    (``finish_columns``)."""
    rows = [_row(r, p, eos_ids) if r is not None else _ERROR_ROW for r, p in zip(ok, params)]
    cols = dict(zip(_COLUMNS, map(list, zip(*rows)))) if rows else {name: [] for name in _COLUMNS}
    cols[ERROR] = [None if r is not None else e for r, e in zip(ok, errors)]
    return cols


def _row(r: RequestOutput, p: SamplingParams, eos_ids: frozenset[int]) -> tuple:
    return _get(r) + tuple([take(r, p, eos_ids) for take in _TAKES])
