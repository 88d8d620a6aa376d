"""The KV page pool's host book: preempted rows wait oldest first (``PausedRows``)."""
from __future__ import annotations

import numpy as np

from orthrus.engine.host.admission import PausedRows, Seat


def test_paused_rows_wait_first_preempted_last_in_line_and_mask_their_slots():
    paused = PausedRows(6)
    for slot in (5, 2, 4):                 # preempted newest first: each goes first in line
        paused.push(Seat(slot, np.zeros(1, dtype=np.int64), [], False))
    assert list(paused.seats) == [4, 2, 5] and paused.slots().tolist() == [2, 4, 5] and len(paused) == 3
    paused.pop(2)
    paused.pop(3)                          # not paused: no-op
    assert list(paused.seats) == [4, 5] and paused.mask.tolist() == [False] * 4 + [True, True]
    paused.clear()
    assert not paused and not paused.mask.any()
