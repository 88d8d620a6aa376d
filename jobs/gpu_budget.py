"""A run of named steps under one wall-clock budget, its report rewritten after every step
(``jobs/gpu_check.py``: a lent GPU gives minutes, and a run stopped early must still return what
it measured)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple


def guard(fn: Callable[[], object]) -> object:
    """``fn()``, or its error as a string: an API missing from this torch must not end the check."""
    try:
        return fn()
    except Exception as err:
        return f"error: {type(err).__name__}: {err}"



STAMP = Path(__file__).resolve().parents[1] / "GPU_CHECK_COMMIT"   # the commit, for a tree without .git


def commit() -> str | None:
    """The commit this tree is: ``git rev-parse HEAD`` (with "+dirty" for uncommitted changes), else
    the stamp ``--dry-run`` wrote (None: neither)."""
    root = STAMP.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return STAMP.read_text().strip() if STAMP.exists() else None


class BudgetExhausted(BaseException):
    """Raised by the timer inside a step that outran the budget. A BaseException, so that the
    engine's ``except Exception`` (which resets it and re-raises as EngineStepError) lets it through."""


def _fire(signum, frame) -> None:
    raise BudgetExhausted()


@contextmanager
def deadline(seconds: float):
    """Interrupt the block after ``seconds`` (main thread, POSIX; elsewhere no timer)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGALRM, _fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Step(NamedTuple):
    name: str
    run: Callable[[], dict]
    why_not: Callable[[], str | None] = lambda: None     # a reason it cannot run here, or None



def write_json(path: Path, data: dict) -> None:
    """Temp file + rename: a reader (or a run killed mid-write) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)



class Budget:
    """Runs steps while their estimates fit the time left; a step outrunning the budget is
    interrupted; every step's entry (status, result or reason, seconds) lands in ``report["steps"]``."""

    def __init__(self, budget_s: float, estimates: dict[str, float], path: Path, report: dict) -> None:
        self.budget_s, self.estimates, self.path, self.report = budget_s, estimates, path, report
        self.start, self.exhausted = time.monotonic(), False

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.monotonic() - self.start, 2)
        write_json(self.path, self.report)

    def estimate(self, step: "Step") -> float:
        return self.estimates.get(step.name, 30)     # a step without a figure (the CPU smoke run's)

    def _skip_reason(self, step: "Step", estimate: float) -> str | None:
        if self.exhausted:
            return "the budget ran out during an earlier step"
        why_not = guard(step.why_not)
        if why_not:
            return str(why_not)
        if self.left() < estimate:
            return f"{max(self.left(), 0):.0f} s of the budget left; the step is estimated at {estimate:g} s"
        return None

    def run(self, step: Step) -> None:
        estimate = self.estimate(step)
        entry: dict = {"estimate_s": estimate}
        reason = self._skip_reason(step, estimate)
        if reason:
            entry.update(status="skipped", reason=reason)
        else:
            print(f"[gpu_check] {step.name}: running ({self.left():.0f} s left)", flush=True)
            t = time.monotonic()
            try:
                with deadline(self.left()):
                    result = step.run()
                entry.update(status="ok", result=result)
            except BudgetExhausted:
                self.exhausted = True
                entry.update(status="interrupted", reason="the budget ran out during this step")
            except Exception as err:       # recorded (a graph capture that raises, too); the next step runs
                entry.update(status="error", error=f"{type(err).__name__}: {err}"[:2000],
                             traceback=traceback.format_exc()[-4000:])
            entry["seconds"] = round(time.monotonic() - t, 2)
        self.report["steps"][step.name] = entry
        self.save()
        print(f"[gpu_check] {step.name}: {entry['status']} {entry.get('seconds', '')} {entry.get('reason', '')}"
              f"{entry.get('error', '')}", flush=True)
