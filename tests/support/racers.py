"""Processes that race for one lease, ordered by barriers on files, never by the clock.

Every racer announces itself, then waits for a start file, so all of them try at once however long
each took to start (a loaded machine can take seconds to import). The winner holds the lease until
a release file appears, which the test creates only after every racer has given its first answer:
no racer can arrive after the winner let go, however slow.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.hang import HANG_S
from support.ray_head import wait_for

# Prepended to a racer's script: argv[1] is the barrier directory, argv[2] the racer's index; the
# script's own arguments follow. ``hold()`` is for the winner, before it releases the lease.
PROLOGUE = """
import sys, time
from pathlib import Path
_gate = Path(sys.argv[1])
(_gate / f"ready-{sys.argv[2]}").touch()
while not (_gate / "go").exists():
    time.sleep(0.005)

def hold():
    while not (_gate / "release").exists():
        time.sleep(0.01)

"""


def race(script: str, args: list[str], n: int, gate: Path, cwd: Path) -> list[str]:
    """Start ``n`` racers running ``script`` (after :data:`PROLOGUE`) with ``args`` → each one's last
    line of output, sorted."""
    gate.mkdir(parents=True)
    procs = [subprocess.Popen([sys.executable, "-c", PROLOGUE + script, str(gate), str(i), *args], cwd=cwd,
                              stdout=subprocess.PIPE, text=True) for i in range(n)]
    try:
        wait_for(lambda: len(list(gate.glob("ready-*"))) == n or any(p.poll() is not None for p in procs),
                 f"{n} racers to start")
        (gate / "go").touch()
        lines = [_until_answer(p) for p in procs]            # every racer has answered (the winner holds)
    finally:
        (gate / "go").touch()
        (gate / "release").touch()
    for p, seen in zip(procs, lines):
        seen += p.stdout.read().splitlines()                  # through the same buffered reader
        p.wait(timeout=HANG_S)
    return sorted(seen[-1] if seen else "" for seen in lines)


def _until_answer(proc: subprocess.Popen) -> list[str]:
    """The racer's lines up to its answer ("won" or "refused"; a takeover notice may come first)."""
    seen: list[str] = []
    while line := proc.stdout.readline():
        seen.append(line.rstrip("\n"))
        if seen[-1] in ("won", "refused"):
            break
    return seen
