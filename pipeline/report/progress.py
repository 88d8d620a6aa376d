"""The driver's one progress display: rows committed of expected, tokens/s and ETA.

On a terminal it is a tqdm bar (Ray Data's own bars are switched off in ``dataset.py``, so it is
the only one). Where output goes to a log -- ``ray job submit``, a scheduler, a pipe -- a bar would
be a stream of carriage returns, so it prints a plain line at most every ``interval_s`` seconds
instead, and always the last one.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """Rows committed of ``expected`` (``done_before`` were committed by earlier runs)."""

    def __init__(self, expected: int, done_before: int, echo: Callable[[str], None] = print,
                 stream: TextIO | None = None, bar: bool | None = None, interval_s: float = 10.0) -> None:
        self.expected, self.done = expected, done_before
        self.echo, self.interval_s = echo, interval_s
        self._rows_this_run = 0
        self._first: tuple[float, int] | None = None    # (time, rows of this run) at the first commit
        self._last_line = 0.0
        stream = stream or sys.stderr
        use_bar = bar if bar is not None else stream.isatty()
        self.bar = None
        if use_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=expected, initial=done_before, desc="rows", unit="row", file=stream,
                            dynamic_ncols=True, smoothing=0.1)

    def eta_seconds(self) -> float | None:
        """Remaining rows at this run's row rate, measured from the first commit on (start-up --
        Ray, actors, model load -- is not a rate); None until there is a rate."""
        if self._first is None:
            return None
        elapsed, rows = time.time() - self._first[0], self._rows_this_run - self._first[1]
        if self.done >= self.expected:
            return 0.0
        return (self.expected - self.done) / (rows / elapsed) if rows > 0 and elapsed > 0 else None

    def update(self, rows: int, tokens_per_second: float | None) -> None:
        """``rows`` more were committed; the job's tokens/s is shown beside the count."""
        if self._first is None:
            self._first = (time.time(), self._rows_this_run + rows)
        self.done += rows
        self._rows_this_run += rows
        rate = "n/a" if tokens_per_second is None else f"{tokens_per_second:.0f}"
        if self.bar is not None:
            self.bar.update(rows)
            self.bar.set_postfix_str(f"{rate} tok/s", refresh=False)
            return
        now = time.time()
        if now - self._last_line >= self.interval_s or self.done >= self.expected:
            self._last_line = now
            pct = 100 * self.done / self.expected if self.expected else 100.0
            self.echo(f"[orthrus] progress {self.done}/{self.expected} rows ({pct:.1f}%) | {rate} tok/s | "
                      f"ETA {_eta(self.eta_seconds())}")

    def write(self, message: str) -> None:
        """A message that must not tear the bar."""
        if self.bar is not None:
            self.bar.write(message)
        else:
            self.echo(message)

    def close(self) -> None:
        """End the bar (a no-op for log lines)."""
        if self.bar is not None:
            self.bar.close()
