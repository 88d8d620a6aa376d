"""One writer per output directory: an exclusive lease, taken before Ray starts.

``<output>/_lease.json`` names its holder (run id, host, pid and the pid's start time, the command,
the start) and carries a heartbeat the holder refreshes every ``HEARTBEAT_S`` seconds. It is
created with ``O_CREAT | O_EXCL``, so of two jobs started together exactly one gets it; the other
is refused at once (exit status 2) with the holder named.

A lease whose holder is dead is taken over: on the same host when its pid is gone (or reused by
another process: the start time differs), on another host when its heartbeat is older than
``STALE_AFTER_S``. Takers are serialised by a second ``O_EXCL`` file, and a taker deletes the lease
only if it is still the stale one it judged; then it creates its own with ``O_EXCL`` like anyone.
The holder checks its token at every heartbeat and, through
``OutputDir.commit``, right before every commit; a holder that finds another token has lost the
lease and commits nothing more (``lost``), so a mistaken takeover costs the loser its run, not
the output. A heartbeat that cannot be written is retried; after ``STALE_AFTER_S / 2`` without one
the holder gives up the lease too (another host may judge it stale by then). Across hosts,
staleness compares the heartbeat with the taker's clock: hosts are assumed to keep time (NTP)
within a fraction of ``STALE_AFTER_S``.

Local and shared filesystems; object stores have no exclusive create and use the listing protocol
of ``object_lease.py`` (same interface).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from pipeline.config import ConfigError

LEASE = "_lease.json"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 120.0
TAKEOVER_EXPIRES_S = 30.0


class LeaseHeld(ConfigError):
    """Another live job holds the output directory."""


def _pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(info: dict, now: float) -> bool:
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
    return start is None or _pid_start(pid) in (None, start)


def _read(path: Path) -> dict | None:
    """The lease's content; {} if unreadable (a holder killed between create and write); None if absent."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def describe(info: dict, now: float) -> str:
    """The holder, for messages."""
    age = now - float(info.get("heartbeat", now))
    return (f"run {info.get('run_id', '?')} (pid {info.get('pid', '?')} on {info.get('host', '?')}, started "
            f"{info.get('started', '?')}, last heartbeat {age:.0f} s ago: {info.get('command', '?')})")


def held_by(root, info: dict, now: float) -> LeaseHeld:
    """The refusal naming the live holder ``info`` of output ``root`` (a path or URI)."""
    return LeaseHeld(f"output.path {root} is in use by another job: {describe(info, now)}. Wait for it to end "
                     "or stop it; a lease whose job is dead is taken over automatically")


def check_free(root: Path) -> None:
    """Raise :class:`LeaseHeld` naming the holder if a live job holds ``root`` (no side effects)."""
    info = _read(root / LEASE)
    now = time.time()
    if info and _alive(info, now):
        raise held_by(root, info, now)


class Lease:
    """The held lease; ``release()`` (or leaving the ``with`` block) gives it back."""

    def __init__(self, root: Path, run_id: str) -> None:
        self.path = root / LEASE
        self._init_info(run_id)
        root.mkdir(parents=True, exist_ok=True)
        for _ in range(50):
            if self._create() or self._take_over():
                break
        else:
            raise LeaseHeld(f"output.path {root}: could not take the lease ({self.path}); another job keeps taking it")
        self._thread = threading.Thread(target=self._beat, name="orthrus-lease", daemon=True)
        self._thread.start()

    def _init_info(self, run_id: str) -> None:
        self.token = uuid.uuid4().hex
        self.info = {"token": self.token, "run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(),
                     "pid_start": _pid_start(os.getpid()), "command": " ".join(sys.argv)[:300],
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "heartbeat": time.time()}
        self.lost = False
        self._stop = threading.Event()

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.info, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _take_over(self) -> bool:
        """Replace a stale lease by ours (→ True); False to try again; raise if its holder lives.

        Takers are serialised by a second O_EXCL file (``_lease.json.takeover``), and only takers
        ever delete a lease, so the one deleted is the stale one that was judged, never a fresh one.
        """
        info, now = _read(self.path), time.time()
        if info is None:
            return False                              # gone meanwhile: try to create again
        if info and _alive(info, now):
            check_free(self.path.parent)
        if not info and now - self.path.stat().st_mtime < STALE_AFTER_S:
            raise LeaseHeld(f"output.path {self.path.parent}: a job is taking the lease right now ({self.path})")
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
            print(f"[orthrus] took over the stale lease of {describe(info, now)}", flush=True)
            return self._create()
        finally:
            mutex.unlink(missing_ok=True)

    def verify(self) -> bool:
        """Whether the lease still names this job (False also sets ``lost``); an unreadable lease
        file counts as ours until a heartbeat rewrites it."""
        if self.lost or not self._ours():
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
                self._write()
                last_ok = time.time()
            except OSError as e:   # a full disk or a network filesystem hiccup: try again next beat
                if time.time() - last_ok > STALE_AFTER_S / 2:
                    self.lost = True
                    print(f"[orthrus] ERROR: cannot refresh the output lease {self.path} ({e}); committing stops",
                          flush=True)
                    return

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._remove_if_ours()

    def _ours(self) -> bool:
        info = _read(self.path)
        return not (info is None or (info and info.get("token") != self.token))

    def _write(self) -> None:
        tmp = self.path.with_name(f"{LEASE}.{self.token}.tmp")
        tmp.write_text(json.dumps(self.info))
        os.replace(tmp, self.path)

    def _remove_if_ours(self) -> None:
        if (_read(self.path) or {}).get("token") == self.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
