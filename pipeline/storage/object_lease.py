"""One writer per output prefix on an object store, where there is no exclusive create.

A job that wants ``<output>/`` first lists ``<output>/_leases/``: a live lease object in state
``held`` means another job holds the prefix (refused, exit status 2). Otherwise it writes its own
object ``_leases/<token>.json`` in state ``claim`` (run id, host, pid and its start time, command,
heartbeat, as in ``lease.py``) and lists again:

- no other live object (claim or held): it holds the lease, and rewrites its object as ``held``;
- another one: it deletes its own claim and tries again after a random pause (contention).

Two jobs cannot both hold: S3 and GCS give read-after-write and list-after-write consistency, so
of two claims whose writes both precede both listings, each job sees the other and neither holds;
if one job's listing came before the other's write, the later one sees the earlier one's object.
The holder keeps the lease while its own object is there and no other live ``held`` object is
(``verify``, at every heartbeat and before every commit); otherwise it stops committing
(``lost``), so at most one job ever commits.

Liveness is judged as for the local lease: on the same host by pid (and its start time), across
hosts by a heartbeat younger than ``STALE_AFTER_S``. A stale lease object is deleted by the next
job, which says so.
"""
from __future__ import annotations

import json
import random
import threading
import time

import pyarrow.fs as pafs

from pipeline.storage.lease import HEARTBEAT_S, STALE_AFTER_S, LeaseHeld, _alive, describe, held_by
from pipeline.storage.lease import Lease as _LocalLease
from pipeline.storage.uris import STORE_ERRORS, Location, access_error

LEASES = "_leases"
_ATTEMPTS = 20


def _put(fs: pafs.FileSystem, path: str, info: dict) -> None:
    with fs.open_output_stream(path) as f:
        f.write(json.dumps(info).encode())


def _listed(loc: Location) -> dict[str, dict]:
    """Every lease object under ``loc/_leases``: {path: content} ({} content if unreadable)."""
    found = loc.fs.get_file_info(pafs.FileSelector(f"{loc.path}/{LEASES}", allow_not_found=True))
    leases = {}
    for f in found:
        if f.type != pafs.FileType.File or not f.path.endswith(".json"):
            continue
        try:
            with loc.fs.open_input_stream(f.path) as src:
                leases[f.path] = json.loads(src.read())
        except FileNotFoundError:
            continue                    # released meanwhile
        except (OSError, ValueError):
            # being written: counts as live until it ages out (its time in the store as the heartbeat)
            leases[f.path] = {"unreadable": True, "heartbeat": f.mtime.timestamp() if f.mtime else time.time()}
    return leases


def _still_stale(loc: Location, path: str, info: dict) -> bool:
    """Read a lease judged stale once more right before deleting it: its holder may just have beaten."""
    try:
        with loc.fs.open_input_stream(path) as src:
            again = json.loads(src.read())
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return bool(info.get("unreadable"))       # still unreadable: as judged
    return again.get("heartbeat") == info.get("heartbeat") and not _alive(again, time.time())


def _live_others(loc: Location, own: str | None, announce: bool, held_only: bool = False) -> dict[str, dict]:
    """Live lease objects other than ``own`` (only those held, with ``held_only``); stale ones are
    deleted on the way."""
    now, live = time.time(), {}
    for path, info in _listed(loc).items():
        if path == own or (held_only and _alive(info, now) and info.get("state") != "held"):
            continue
        if _alive(info, now):
            live[path] = info
            continue
        if not _still_stale(loc, path, info):
            continue
        try:
            loc.fs.delete_file(path)
            if announce:
                print(f"[orthrus] took over the stale lease of {describe(info, now)}", flush=True)
        except FileNotFoundError:
            pass
    return live


def check_free(loc: Location) -> None:
    """Raise :class:`LeaseHeld` naming the holder if a live job holds ``loc`` (no side effects)."""
    now = time.time()
    for info in _listed(loc).values():
        if _alive(info, now) and info.get("state") == "held":
            raise held_by(loc.uri, info, now)


class ObjectLease(_LocalLease):
    """The held lease on an object-store prefix (same interface as :class:`pipeline.storage.lease.Lease`)."""

    def __init__(self, loc: Location, run_id: str) -> None:  # noqa: D107 - see the module docstring
        self.loc, self.fs = loc, loc.fs
        _LocalLease._init_info(self, run_id)
        self.info["state"] = "held"
        self.path = f"{loc.path}/{LEASES}/{self.token}.json"
        try:
            self._acquire()
        except STORE_ERRORS as e:
            self._remove_if_ours()
            raise access_error("output.path", loc, "take the lease (_leases/) in", e) from None
        self._thread = threading.Thread(target=self._beat, name="orthrus-lease", daemon=True)
        self._thread.start()

    def _acquire(self) -> None:
        loc = self.loc
        for _ in range(_ATTEMPTS):
            others = _live_others(loc, None, announce=True, held_only=True)
            if others:
                raise held_by(loc.uri, next(iter(others.values())), time.time())
            _put(self.fs, self.path, {**self.info, "state": "claim"})
            if not _live_others(loc, self.path, announce=False):
                _put(self.fs, self.path, self.info)
                break
            self.fs.delete_file(self.path)          # contended: both back off, one comes back first
            time.sleep(random.uniform(0.2, 2.0))
        else:
            raise LeaseHeld(f"output.path {loc.uri}: could not take the lease; other jobs keep contending for it "
                            f"(a claim left by a job killed while taking it ages out after {STALE_AFTER_S:.0f} s)")

    def _ours(self) -> bool:
        try:
            return self.fs.get_file_info(self.path).type == pafs.FileType.File and \
                not _live_others(self.loc, self.path, announce=False, held_only=True)
        except STORE_ERRORS:
            return True    # the store did not answer: the next heartbeat asks again

    def _write(self) -> None:
        _put(self.fs, self.path, self.info)

    def _remove_if_ours(self) -> None:
        try:
            self.fs.delete_file(self.path)
        except STORE_ERRORS:
            pass             # gone already, or the store is away: it ages out


__all__ = ["ObjectLease", "check_free", "HEARTBEAT_S", "STALE_AFTER_S", "LEASES"]
