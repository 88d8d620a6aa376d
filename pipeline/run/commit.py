"""The driver's commit loop: blocks from Ray Data stream into parts (``output/parts.py``).

Blocks are pulled by a daemon thread into a small queue, so the loop keeps its clocks while no
block arrives: a part open for ``output.part_seconds`` commits even when the actors are slow, and
``behaviour.max_wall_seconds`` stops the job on time. At the end (or at the deadline) the open part
commits; the blocks still in flight are generated again by ``--resume``.

The loop's memory is one open part's row-group buffer plus the queue; its work per block is
vectorised (coordinates, aggregates, the cast to the output schema) and the per-batch figures come
as one record per batch, so it is bounded by blocks, never by per-row Python.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.output import stats as St
from pipeline.output.parts import PartWriter
from pipeline.report.progress import Progress
from pipeline.report.throughput import ThroughputTracker
from pipeline import schema as S
from pipeline.exceptions import first_of
from pipeline.inputs.source import INPUT_ERROR_MARK, InputFileError

_TICK_S = 1.0


@dataclass
class CommitLoop:
    """Everything the loop feeds: the open part, the throughput and progress displays."""

    writer: PartWriter
    schema: pa.Schema
    tracker: ThroughputTracker
    progress: Progress
    ids_checked: Future | None = None    # the distributed id check; the first commit waits for it
    deadline: float | None = None        # behaviour.max_wall_seconds as time.time(); bounds that wait

    def _ids(self) -> None:
        """Wait for the id check (raises ConfigError on a duplicate id: nothing committed yet)."""
        if self.ids_checked is None:
            return
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.time())
        try:
            self.ids_checked.result(timeout=timeout)
        except FutureTimeout:
            raise DeadlineReached() from None
        self.ids_checked = None

    def add(self, block: pa.Table) -> None:
        """One block of finished rows: account its batch records, append its rows to the open part."""
        self._ids()
        self.tracker.add(block)
        if not block.num_rows:
            return
        coords = [np.asarray(block[c].to_numpy(), np.int64) for c in (S.FILE, S.ROW, "sample_index")]
        self.writer.add(S.to_output_table(block, self.schema), *coords, prefill=St.prefill_of_block(block))
        self.progress.update(block.num_rows, self.tracker.steady_tokens_per_second())

    def commit(self) -> None:
        if self.writer.rows:
            self._ids()
        self.writer.commit()


class DeadlineReached(Exception):
    """The deadline came while the first commit still waited for the id check."""


def run_loop(blocks, loop: CommitLoop, deadline: float | None, halt=None) -> bool:
    """Commit every block of the ``blocks`` iterator → whether the deadline (``time.time()``) stopped it.

    An input file found unreadable mid-run (:class:`InputFileError`) commits the open part (its rows
    are good) and is raised; any other failure drops the open part. ``halt`` stops the producer when
    the loop ends early (the deadline, a failure): the pump may be waiting inside the iterator for a
    block that would take minutes, and the producer must stop while Ray is still up.
    """
    pending: queue.Queue = queue.Queue(maxsize=2)
    stop = threading.Event()
    pump = threading.Thread(target=_pump, args=(blocks, pending, stop), name="orthrus-blocks", daemon=True)
    pump.start()
    loop.deadline = deadline
    try:
        while True:
            now = time.time()
            if deadline is not None and now >= deadline:
                loop.commit()
                return True
            waits = [_TICK_S, loop.writer.seconds_left()]
            if deadline is not None:
                waits.append(deadline - now)
            try:
                kind, item = pending.get(timeout=min(w for w in waits if w is not None))
            except queue.Empty:
                kind, item = "tick", None
            if kind == "end":
                loop.commit()
                return False
            if kind == "error":
                raise item
            if kind == "block":
                loop.add(item)
            if loop.writer.due():
                loop.commit()
    except DeadlineReached:
        loop.writer.abort()          # nothing in it can be committed before the ids are proven unique
        return True
    except BaseException as e:
        found = input_error(e)
        if found is not None:
            loop.commit()
            raise InputFileError(f"{found.message}. The parts committed so far are complete; fix or remove the "
                                 "file, then rerun with --resume") from e
        loop.writer.abort()
        raise
    finally:
        stop.set()
        if pump.is_alive() and halt is not None:
            halt()
        pump.join(timeout=30)      # the pump closes the iterator (see _pump) before Ray may shut down
        settle_ray_data_threads()


# Ray Data's consumer and executor threads (Ray 2.60's names). Closing the iterator only signals
# them; one still running when ray.shutdown() destroys the core worker calls into Ray and is
# killed by it with _exit(1): the driver then exits 1 with no message (seen after a failed commit
# with several batches in flight). So the loop waits for them before anything may shut Ray down.
# The job's own id-check thread (``orthrus-ids``) calls into Ray too. The wait is a hang guard,
# not a speed bound: the threads end as soon as the executor has wound down its in-flight tasks,
# which on a loaded machine took more than the 10 s once allowed (a driver run in-process was
# killed by Ray after an unreadable input file, 2026-12-07).
SETTLE_S = 120.0
_RAY_DATA_THREADS = ("iter_threaded", "StreamingExecutor-", "orthrus-ids")


def ray_data_threads() -> list[threading.Thread]:
    """Ray Data threads of this process still running."""
    return [t for t in threading.enumerate() if t.is_alive() and t.name.startswith(_RAY_DATA_THREADS)]


def settle_ray_data_threads(timeout: float = SETTLE_S) -> bool:
    """Wait (bounded) for Ray Data's threads to end → whether none is left."""
    deadline = time.monotonic() + timeout
    for t in ray_data_threads():
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    return not ray_data_threads()


def _pump(blocks, out: queue.Queue, stop: threading.Event) -> None:
    """Move blocks into ``out`` until the end, an error, or ``stop``; then close the iterator, so
    Ray Data's executor stops while Ray is still up (left to garbage collection, its threads can
    outlive ``ray.shutdown()``)."""
    try:
        for block in blocks:
            if not _put(out, ("block", block), stop):
                return
        _put(out, ("end", None), stop)
    except BaseException as e:  # noqa: BLE001 - handed to the committing thread
        _put(out, ("error", e), stop)
    finally:
        close = getattr(blocks, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass


def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
    """Put unless ``stop`` is set first → whether it was put."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.5)
            return True
        except queue.Full:
            continue
    return False


def input_error(error: BaseException) -> InputFileError | None:
    """The :class:`InputFileError` behind whatever Ray wrapped it in (or None)."""
    found = first_of(error, InputFileError)
    if found is not None:
        return InputFileError(found.message)
    text = str(error)
    if INPUT_ERROR_MARK in text:
        message = text.split(INPUT_ERROR_MARK, 1)[1].strip().splitlines()[0]
        return InputFileError(message)
    return None
