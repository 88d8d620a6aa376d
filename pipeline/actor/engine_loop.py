"""One engine per actor, stepped in its own thread; the actor's batches submit groups of requests to it.

Why a thread: Ray Data hands an async actor several batches at once (``max_concurrency``), and the
engine must keep every slot busy across their boundaries. Each batch's coroutine submits its rows
as a *group* and awaits the group's future; the engine thread adds groups' requests as they come,
steps while anything is unfinished, and resolves a group's future on the actor's event loop when
its last request finishes. The engine is touched by this thread only.

Failures: if a step raises, the engine drops every request (``EngineStepError``) and every group
in it fails with the cause. Such a failure does not say which row was at fault, so the caller
retries with *exclusive* groups: an exclusive group waits until the engine is empty, runs alone
(no other group is started meanwhile) and its failure is attributable to its own rows.

The loop can also own an *audit* engine (plain AR on the same model weights, its own small KV
cache): groups sent there (``engine="audit"``) re-decode rows to check the main engine's output.
Both engines are stepped by this one thread, alternately, so device work is never issued from two
threads (CUDA graph capture forbids that); while an exclusive group runs, the audit engine waits,
so the group is alone on the device. A ``row_timeout_s`` aborts requests (in either engine) that
have held their slot longer; they come back with ``finish_reason == "abort"``.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orthrus import EngineStepError, RequestOutput, SamplingParams
from pipeline.actor.records import EngineSnapshot

if TYPE_CHECKING:        # the engine (torch) loads in the actor only; the job's driver imports this module too
    from orthrus import OrthrusEngine


MAIN, AUDIT = "main", "audit"
_TIMEOUT_CHECK_S = 0.2        # how often running requests are compared with the row timeout


class GroupFailed(Exception):
    """A group's requests were dropped because a step raised; ``cause`` is that step's error."""

    def __init__(self, cause: BaseException, alone: bool) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.alone = alone           # True: the group ran alone, so the error is its own


@dataclass(eq=False)
class _Group:
    prompts: list[list[int]]
    params: list[SamplingParams]
    exclusive: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    engine: str = MAIN
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)


class EngineLoop:
    """Owns ``engine`` and steps it in a daemon thread; ``await run(...)`` decodes one group."""

    def __init__(self, engine: OrthrusEngine, audit_engine: OrthrusEngine | None = None,
                 row_timeout_s: float | None = None) -> None:
        self.engine = engine
        self.engines = {MAIN: engine, **({AUDIT: audit_engine} if audit_engine is not None else {})}
        self.row_timeout_s = row_timeout_s
        self._cv = threading.Condition()
        self._inbox: list[_Group] = []
        self._cancelled: list[_Group] = []
        self._held: deque[_Group] = deque()        # normal groups waiting for exclusive ones to end
        self._audits: deque[_Group] = deque()      # audit groups waiting for exclusive ones to end
        self._exclusive: deque[_Group] = deque()
        self._active: dict[str, _Group] = {}       # request id -> its group, for groups in an engine
        self._running_exclusive = False
        self._engine_seconds = 0.0                 # inside steps of either engine (device busy time)
        self._next_timeout_check = 0.0
        self.timed_out = 0                         # requests aborted by the row timeout so far
        self._thread = threading.Thread(target=self._loop, name="orthrus-engine", daemon=True)
        self._thread.start()

    def occupancy(self) -> EngineSnapshot:
        """A snapshot of the main engine's counters (racy reads are fine for statistics)."""
        return EngineSnapshot(self.engine.stats, self.engine.max_batch_size, int(self._engine_seconds * 1000),
                              self.engine.kv_pages)

    async def run(self, prompts: list[list[int]], params: list[SamplingParams],
                  exclusive: bool = False, engine: str = MAIN) -> list[RequestOutput]:
        """Decode these rows (in the engine with other groups, or alone) → outputs in row order.

        ``engine="audit"``: in the audit engine (never exclusive). Raises :class:`GroupFailed` if a
        step failed while they were in the engine.
        """
        if engine not in self.engines:
            raise ValueError(f"no {engine!r} engine in this loop (engines: {sorted(self.engines)})")
        loop = asyncio.get_running_loop()
        group = _Group(prompts, params, exclusive and engine == MAIN, loop, loop.create_future(), engine)
        with self._cv:
            self._inbox.append(group)
            self._cv.notify()
        try:
            return await group.future
        except asyncio.CancelledError:       # the batch was cancelled: free its slots
            with self._cv:
                self._cancelled.append(group)
                self._cv.notify()
            raise

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._inbox or self._cancelled or self._active or self._exclusive or self._held
                           or self._audits):
                    self._cv.wait()
                inbox, self._inbox = self._inbox, []
                cancelled, self._cancelled = self._cancelled, []
            try:
                for g in cancelled:
                    self._cancel(g)
                for g in inbox:
                    queue = self._audits if g.engine != MAIN else self._exclusive if g.exclusive else self._held
                    queue.append(g)
                self._start_groups()
                self._expire()
                for name, engine in self.engines.items():
                    # an exclusive group runs alone on the device: the audit engine waits too
                    if engine.has_unfinished_requests() and not (name != MAIN and self._running_exclusive):
                        self._step(name, engine)
            except Exception as err:  # noqa: BLE001 - a bug here must fail the batches, not hang them
                self._fail_everything(err)

    def _fail_everything(self, err: BaseException) -> None:
        """Fail every group this loop knows and empty the engine (the actor then retries as usual)."""
        groups = {id(g): g for g in [*self._active.values(), *self._held, *self._exclusive, *self._audits]}.values()
        self._active.clear()
        self._held.clear()
        self._exclusive.clear()
        self._audits.clear()
        for engine in self.engines.values():
            engine.reset()
        for g in groups:
            self._fail(g, err)

    def _start_groups(self) -> None:
        """Start held and audit groups unless an exclusive one is due; start an exclusive one once
        both engines are empty (it runs alone on the device)."""
        if self._running_exclusive:
            return
        if self._exclusive:
            if not self._active:
                self._running_exclusive = True
                self._start(self._exclusive.popleft())
            return
        while self._held:
            self._start(self._held.popleft())
        while self._audits:
            self._start(self._audits.popleft())

    def _start(self, group: _Group) -> None:
        engine = self.engines[group.engine]
        try:
            for prompt, p in zip(group.prompts, group.params):
                rid = engine.add_request(prompt, p)
                group.ids.append(rid)
                self._active[rid] = group
        except Exception as err:  # noqa: BLE001 - the group fails, the loop lives on
            self._drop(group)
            self._fail(group, err)
            return
        if not group.ids:
            self._resolve(group)

    def _drop(self, group: _Group) -> None:
        """Abort a group's requests (their outputs, returned by a later step, are ignored)."""
        for rid in group.ids:
            if self._active.pop(rid, None) is not None:
                self.engines[group.engine].abort_request(rid)
        if group.exclusive:
            self._running_exclusive = False

    def _cancel(self, group: _Group) -> None:
        for queue in (self._held, self._exclusive, self._audits):
            if group in queue:
                queue.remove(group)
                return              # never started: nothing of it in an engine
        self._drop(group)

    def _expire(self) -> None:
        """Abort requests (main or audit) that have held a slot longer than the row timeout."""
        now = time.perf_counter()
        if self.row_timeout_s is None or now < self._next_timeout_check:
            return
        self._next_timeout_check = now + min(_TIMEOUT_CHECK_S, self.row_timeout_s / 4)
        for engine in self.engines.values():
            for rid, seconds in engine.running_seconds().items():
                if seconds > self.row_timeout_s and rid in self._active:
                    engine.abort_request(rid)    # returned by the next step with finish_reason "abort"
                    self.timed_out += 1

    def _step(self, name: str, engine: OrthrusEngine) -> None:
        start = time.perf_counter()
        try:
            outputs = engine.step()
        except EngineStepError as err:
            groups = {id(g): g for g in self._active.values() if g.engine == name}.values()
            for rid in [rid for rid, g in self._active.items() if g.engine == name]:
                del self._active[rid]
            for g in groups:
                self._fail(g, err.cause)
            return
        finally:
            self._engine_seconds += time.perf_counter() - start
        for out in outputs:
            group = self._active.pop(out.request_id, None)
            if group is None:      # a request of a group that failed at start and was aborted
                continue
            group.outputs[out.request_id] = out
            if len(group.outputs) == len(group.ids):
                self._resolve(group)

    def _resolve(self, group: _Group) -> None:
        if group.exclusive:
            self._running_exclusive = False
        result = [group.outputs[rid] for rid in group.ids]
        group.loop.call_soon_threadsafe(_set, group.future, result, None)

    def _fail(self, group: _Group, err: BaseException) -> None:
        if group.exclusive:
            self._running_exclusive = False
        group.loop.call_soon_threadsafe(_set, group.future, None, GroupFailed(err, alone=group.exclusive))


def _set(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():       # the awaiting coroutine was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
