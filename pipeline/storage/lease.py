"""One writer per output directory: an exclusive lease, taken before Ray starts.

The lease is a record naming its holder (run id, host, pid and the pid's start time, the command,
the start) with a heartbeat the holder refreshes every ``HEARTBEAT_S`` seconds. A second job is
refused at once (exit status 2) with the holder named; a lease whose holder is dead (pid gone on
the same host, heartbeat older than ``STALE_AFTER_S`` elsewhere) is taken over, which is said.

The holder checks the lease is still its own at every heartbeat and, through ``OutputDir.commit``,
right before every commit (``verify``); a holder that finds it is not has lost the lease and commits
nothing more (``lost``), so a mistaken takeover costs the loser its run, not the output. A
heartbeat that cannot be written is retried; after ``STALE_AFTER_S / 2`` without one the holder
gives up the lease too (another host may judge it stale by then). Nothing is written after
``release``.

:class:`Lease` is all of that, once, over one of two mechanisms (``lease_backends.py``), because
the two kinds of output offer different atomic primitives:

- a local or shared filesystem has an exclusive create (``O_EXCL``): one file ``<output>/_lease.json``
  (``LEASE``), and of two jobs creating it exactly one succeeds (:class:`ExclusiveFileBackend`);
- an object store has no exclusive create, only atomic PUTs and consistent listings: each job
  writes a claim ``<output>/_leases/<token>.json`` (``LEASES``) and holds the lease if a listing
  then shows no other live claim (:class:`ListingClaimBackend`).

``take_lease(where, run_id)`` picks the mechanism from ``where`` (a local path, or an object-store
:class:`~pipeline.storage.uris.Location`).
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Protocol

from pipeline.storage.lease_backends import (LEASE, LEASES, STALE_AFTER_S, ExclusiveFileBackend, LeaseHeld,
                                             ListingClaimBackend, describe, held_by, pid_start, refuse_if_held)
from pipeline.storage.uris import Location

HEARTBEAT_S = 10.0


class LeaseBackend(Protocol):
    """The mechanism under a :class:`Lease`: how a lease record is taken, checked, rewritten, removed."""

    where: Path | str    # the output, for messages
    attempts: int        # take_once rounds before giving up (contention)

    def record(self, token: str) -> Path | str:
        """Where the lease record of the holder of ``token`` is kept."""

    def live_holder(self, now: float) -> dict | None:
        """The record of a live holder, or None (no side effects)."""

    def take_once(self, info: dict) -> bool:
        """One attempt to take the lease for ``info``: True if taken, False to try again; raises
        :class:`LeaseHeld` if a live job holds it."""

    def contended(self) -> LeaseHeld:
        """The refusal after ``attempts`` failed rounds."""

    def still_ours(self, token: str) -> bool:
        """Whether the lease still belongs to ``token``."""

    def write(self, info: dict) -> None:
        """Rewrite our record (the heartbeat); raises OSError on failure."""

    def remove_if_ours(self, token: str) -> None:
        """Delete our record if it is still ours."""


def _backend(where: Path | str | Location) -> LeaseBackend:
    """The mechanism for ``where``: an exclusive file on a filesystem path, listing claims on a store."""
    if isinstance(where, Location):
        return ExclusiveFileBackend(Path(where.path)) if where.local else ListingClaimBackend(where)
    return ExclusiveFileBackend(Path(where))


def take_lease(where: Path | Location, run_id: str) -> Lease:
    """The (not yet taken) lease on output ``where`` for run ``run_id``; taken by ``with`` or ``acquire()``."""
    return Lease(_backend(where), run_id)


def check_free(where: Path | Location) -> None:
    """Raise :class:`LeaseHeld` naming the holder if a live job holds ``where`` (no side effects)."""
    refuse_if_held(_backend(where))


class Lease:
    """One job's exclusive lease on one output; ``release()`` (or leaving the ``with`` block) gives it back."""

    def __init__(self, backend: LeaseBackend, run_id: str) -> None:
        self.token = uuid.uuid4().hex
        self.info = {"token": self.token, "run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(),
                     "pid_start": pid_start(os.getpid()), "command": " ".join(sys.argv)[:300],
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "heartbeat": time.time()}
        self.lost = False
        self._backend = backend
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> Path | str:
        """This job's lease record (file or object), for messages."""
        return self._backend.record(self.token)

    def acquire(self) -> Lease:
        """Take the lease and start the heartbeat; :class:`LeaseHeld` if a live job holds it."""
        if self._stop.is_set():
            raise RuntimeError(f"the lease {self.path} was released; take a new one")
        if self._thread is not None:
            return self
        self.info["heartbeat"] = time.time()   # the record may have been made a while before it is taken
        for _ in range(self._backend.attempts):
            if self._backend.take_once(self.info):
                break
        else:
            raise self._backend.contended()
        self._thread = threading.Thread(target=self._beat, name="orthrus-lease", daemon=True)
        self._thread.start()
        return self

    def verify(self) -> bool:
        """Whether the lease is still this job's (False also sets ``lost``, for good)."""
        if self.lost or not self._backend.still_ours(self.token):
            if not self.lost:
                self.lost = True
                print(f"[orthrus] ERROR: lost the output lease {self.path}; committing stops", flush=True)
        return not self.lost

    def _beat(self) -> None:
        last_ok = time.time()
        while not self._stop.wait(HEARTBEAT_S):
            if not self.verify():
                return
            try:
                self.info["heartbeat"] = time.time()
                if self._stop.is_set():      # released meanwhile: never write the lease back
                    return
                self._backend.write(self.info)
                last_ok = time.time()
            except OSError as e:   # a full disk or a network hiccup: try again next beat
                if time.time() - last_ok > STALE_AFTER_S / 2:
                    self.lost = True
                    print(f"[orthrus] ERROR: cannot refresh the output lease {self.path} ({e}); committing stops",
                          flush=True)
                    return

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours (nothing is written after this)."""
        self._stop.set()
        if self._thread is None:
            return                   # never taken: nothing of ours to remove
        self._thread.join(timeout=5)
        self._backend.remove_if_ours(self.token)

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


__all__ = ["HEARTBEAT_S", "LEASE", "LEASES", "STALE_AFTER_S", "Lease", "LeaseBackend", "LeaseHeld", "check_free",
           "describe", "held_by", "take_lease"]
