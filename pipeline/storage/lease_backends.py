"""The two mechanisms behind :class:`pipeline.storage.lease.Lease`, and how a holder is judged.

A lease is a JSON record naming its holder (token, run id, host, pid and the pid's start time, the
command, the start, a heartbeat). A holder is alive on the same host while its pid runs (and is not
a reused pid: the start time differs), on another host while its heartbeat is younger than
``STALE_AFTER_S``; across hosts this compares the heartbeat with the judge's clock, so hosts are
assumed to keep time (NTP) within a fraction of ``STALE_AFTER_S``.

:class:`ExclusiveFileBackend` (local and shared filesystems): one file ``<output>/_lease.json``
created with ``O_CREAT | O_EXCL``, so of two jobs started together exactly one gets it. A stale one
is taken over: takers are serialised by a second ``O_EXCL`` file, and a taker deletes the lease only
if it is still the stale one it judged, then creates its own with ``O_EXCL`` like anyone.

:class:`ListingClaimBackend` (object stores, which have no exclusive create): a job lists
``<output>/_leases/``; a live object in state ``held`` means another job holds the prefix. Otherwise
it writes its own ``_leases/<token>.json`` in state ``claim`` and lists again:

- no other live object (claim or held): it holds the lease, and rewrites its object as ``held``;
- another one: it deletes its own claim and tries again after a random pause (contention).

Two jobs cannot both hold: S3 and GCS give read-after-write and list-after-write consistency, so
of two claims whose writes both precede both listings, each job sees the other and neither holds;
if one job's listing came before the other's write, the later one sees the earlier one's object.
The holder keeps the lease while its own object is there and no other live ``held`` object is. A
stale lease object is deleted by the next job, which says so.
"""
from __future__ import annotations

import json
import os
import random
import socket
import time
from pathlib import Path

import pyarrow.fs as pafs

from pipeline.config import ConfigError
from pipeline.storage.uris import STORE_ERRORS, Location, access_error

LEASE = "_lease.json"        # the local lease file
LEASES = "_leases"           # the object-store prefix of lease objects
STALE_AFTER_S = 120.0
TAKEOVER_EXPIRES_S = 30.0    # a takeover mutex older than this was left by a taker that died halfway


class LeaseHeld(ConfigError):
    """Another live job holds the output directory."""


# ---------------------------------------------------------------- who holds a lease

def pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(info: dict, now: float) -> bool:
    """Whether the holder ``info`` still runs (pid on this host, heartbeat elsewhere)."""
    if info.get("host") != socket.gethostname():
        return now - float(info.get("heartbeat", 0)) < STALE_AFTER_S
    pid = int(info.get("pid", -1))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, another user's
        pass
    start = info.get("pid_start")
    return start is None or pid_start(pid) in (None, start)


def describe(info: dict, now: float) -> str:
    """The holder, for messages."""
    age = now - float(info.get("heartbeat", now))
    return (f"run {info.get('run_id', '?')} (pid {info.get('pid', '?')} on {info.get('host', '?')}, started "
            f"{info.get('started', '?')}, last heartbeat {age:.0f} s ago: {info.get('command', '?')})")


def held_by(root, info: dict, now: float) -> LeaseHeld:
    """The refusal naming the live holder ``info`` of output ``root`` (a path or URI)."""
    return LeaseHeld(f"output.path {root} is in use by another job: {describe(info, now)}. Wait for it to end "
                     "or stop it; a lease whose job is dead is taken over automatically")


def refuse_if_held(backend: ExclusiveFileBackend | ListingClaimBackend) -> None:
    """Raise :class:`LeaseHeld` naming the holder if a live job holds ``backend``'s output (no side effects)."""
    now = time.time()
    if (holder := backend.live_holder(now)) is not None:
        raise held_by(backend.where, holder, now)


def _took_over(info: dict, now: float) -> None:
    print(f"[orthrus] took over the stale lease of {describe(info, now)}", flush=True)


# ---------------------------------------------------------------- local and shared filesystems

def _read(path: Path) -> dict | None:
    """The lease's content; {} if unreadable (a holder killed between create and write); None if absent."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


class ExclusiveFileBackend:
    """``<root>/_lease.json``, created with ``O_EXCL``; a stale one is taken over under a mutex file."""

    attempts = 50

    def __init__(self, root: Path) -> None:
        self.where, self.path = root, root / LEASE

    def record(self, token: str) -> Path:
        """Where the lease is kept (the same file whoever holds it)."""
        return self.path

    def live_holder(self, now: float) -> dict | None:
        """The live holder's record, or None (no side effects)."""
        info = _read(self.path)
        return info if info and alive(info, now) else None

    def take_once(self, info: dict) -> bool:
        """Create the lease, or replace a stale one (→ True); False to try again; raise if its holder lives."""
        self.where.mkdir(parents=True, exist_ok=True)
        return self._create(info) or self._take_over(info)

    def contended(self) -> LeaseHeld:
        """The refusal after ``attempts`` rounds lost to other takers."""
        return LeaseHeld(f"output.path {self.where}: could not take the lease ({self.path}); "
                         "another job keeps taking it")

    def _create(self, info: dict) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _take_over(self, mine: dict) -> bool:
        """Replace a stale lease by ``mine``. Takers are serialised by a second O_EXCL file
        (``_lease.json.takeover``), and only takers ever delete a lease, so the one deleted is the
        stale one that was judged, never a fresh one."""
        info, now = _read(self.path), time.time()
        if info is None:
            return False                              # gone meanwhile: try to create again
        if info and alive(info, now):
            refuse_if_held(self)                      # reads it again: it may have been replaced meanwhile
        if not info and now - self.path.stat().st_mtime < STALE_AFTER_S:
            raise LeaseHeld(f"output.path {self.where}: a job is taking the lease right now ({self.path})")
        mutex = self.path.with_name(f"{LEASE}.takeover")
        try:
            os.close(os.open(mutex, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            try:
                if now - mutex.stat().st_mtime > TAKEOVER_EXPIRES_S:   # a taker died halfway
                    mutex.unlink()
            except FileNotFoundError:
                pass
            time.sleep(0.05)
            return False
        try:
            again = _read(self.path)
            if again is None or again.get("token") != info.get("token"):
                return False                          # replaced meanwhile: judge again
            self.path.unlink()
            _took_over(info, now)
            return self._create(mine)
        finally:
            mutex.unlink(missing_ok=True)

    def still_ours(self, token: str) -> bool:
        """Whether the lease names ``token``; an unreadable one counts as ours until a heartbeat rewrites it."""
        info = _read(self.path)
        return not (info is None or (info and info.get("token") != token))

    def write(self, info: dict) -> None:
        """Rewrite the lease (the heartbeat) atomically: readers never see half of it."""
        tmp = self.path.with_name(f"{LEASE}.{info['token']}.tmp")
        try:
            tmp.write_text(json.dumps(info))
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)    # a full disk must not leave a half-written temp file behind
            raise

    def remove_if_ours(self, token: str) -> None:
        """Delete the lease if it still names ``token`` (another job's is left alone)."""
        if (_read(self.path) or {}).get("token") == token:
            self.path.unlink(missing_ok=True)


# ---------------------------------------------------------------- object stores

class ListingClaimBackend:
    """``<prefix>/_leases/<token>.json``, claimed and confirmed by listing (see the module docstring)."""

    attempts = 20

    def __init__(self, loc: Location) -> None:
        self.loc, self.fs, self.where = loc, loc.fs, loc.uri

    def record(self, token: str) -> str:
        """The lease object of the job holding ``token``."""
        return f"{self.loc.path}/{LEASES}/{token}.json"

    def live_holder(self, now: float) -> dict | None:
        """The record of a live ``held`` lease object, or None (no side effects: stale ones stay)."""
        for info in self._listed().values():
            if alive(info, now) and info.get("state") == "held":
                return info
        return None

    def take_once(self, info: dict) -> bool:
        """One claim round (→ True: held); False after contention; raise if a live job holds it."""
        own = self.record(info["token"])
        try:
            others = self._live_others(None, announce=True, held_only=True)
            if others:
                raise held_by(self.where, next(iter(others.values())), time.time())
            self._put(own, {**info, "state": "claim"})
            if not self._live_others(own, announce=False):
                self._put(own, {**info, "state": "held"})
                return True
            self.fs.delete_file(own)
        except STORE_ERRORS as e:
            self.remove_if_ours(info["token"])
            raise access_error("output.path", self.loc, "take the lease (_leases/) in", e) from None
        time.sleep(random.uniform(0.2, 2.0))           # contended: both back off, one comes back first
        return False

    def contended(self) -> LeaseHeld:
        """The refusal after ``attempts`` contended rounds."""
        return LeaseHeld(f"output.path {self.where}: could not take the lease; other jobs keep contending for it "
                         f"(a claim left by a job killed while taking it ages out after {STALE_AFTER_S:.0f} s)")

    def still_ours(self, token: str) -> bool:
        """Whether our object is there and no other live job holds the prefix; a store that does not
        answer counts as ours (the next heartbeat asks again)."""
        own = self.record(token)
        try:
            return self.fs.get_file_info(own).type == pafs.FileType.File and \
                not self._live_others(own, announce=False, held_only=True)
        except STORE_ERRORS:
            return True

    def write(self, info: dict) -> None:
        """Rewrite our object (the heartbeat); a PUT is atomic."""
        self._put(self.record(info["token"]), {**info, "state": "held"})

    def remove_if_ours(self, token: str) -> None:
        """Delete our object (others' objects are never touched here)."""
        try:
            self.fs.delete_file(self.record(token))
        except STORE_ERRORS:
            pass             # gone already, or the store is away: it ages out

    def _put(self, path: str, info: dict) -> None:
        with self.fs.open_output_stream(path) as f:
            f.write(json.dumps(info).encode())

    def _listed(self) -> dict[str, dict]:
        """Every lease object under ``_leases/``: {path: content}."""
        found = self.fs.get_file_info(pafs.FileSelector(f"{self.loc.path}/{LEASES}", allow_not_found=True))
        leases = {}
        for f in found:
            if f.type != pafs.FileType.File or not f.path.endswith(".json"):
                continue
            try:
                with self.fs.open_input_stream(f.path) as src:
                    leases[f.path] = json.loads(src.read())
            except FileNotFoundError:
                continue                    # released meanwhile
            except (OSError, ValueError):
                # being written: counts as live until it ages out (its time in the store as the heartbeat)
                leases[f.path] = {"unreadable": True, "heartbeat": f.mtime.timestamp() if f.mtime else time.time()}
        return leases

    def _still_stale(self, path: str, info: dict) -> bool:
        """Read a lease judged stale once more right before deleting it: its holder may just have beaten."""
        try:
            with self.fs.open_input_stream(path) as src:
                again = json.loads(src.read())
        except FileNotFoundError:
            return False
        except (OSError, ValueError):
            return bool(info.get("unreadable"))       # still unreadable: as judged
        return again.get("heartbeat") == info.get("heartbeat") and not alive(again, time.time())

    def _live_others(self, own: str | None, announce: bool, held_only: bool = False) -> dict[str, dict]:
        """Live lease objects other than ``own`` (only those held, with ``held_only``); stale ones are
        deleted on the way."""
        now, live = time.time(), {}
        for path, info in self._listed().items():
            if path == own or (held_only and alive(info, now) and info.get("state") != "held"):
                continue
            if alive(info, now):
                live[path] = info
                continue
            if not self._still_stale(path, info):
                continue
            try:
                self.fs.delete_file(path)
                if announce:
                    _took_over(info, now)
            except FileNotFoundError:
                pass
        return live
