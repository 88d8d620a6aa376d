"""The driver's terminal: the job's own lines; Ray's own chatter goes to a log file.

Ray prints, before and around the job's first line, notices meant for Ray developers: the
token-authentication notice, "Started a local Ray instance", Ray Data's execution plan and
"Progress bars disabled", and a ``core_worker.cc`` line (logged at ERROR level by Ray's C++ core,
though nothing is wrong: Ray Data itself passes its actors' constructor arguments through the
object store, ray-project/ray#53727). By default the job sends them to a log file instead:

- Python: the console handler of the ``ray`` logger keeps only ERROR and above (a real Ray error
  still reaches the terminal); ``ray.data``'s keeps only CRITICAL: its errors are an operator's
  traceback (about 120 lines for a refused input file) of an exception that reaches the job, which
  then says what went wrong in one line (a refusal) or one paragraph (a crash). A file handler gets
  everything from INFO up.
- The actors' lines: Ray relays what each actor prints (a line per batch, behind a
  ``(MapWorker(MapBatches(GenerationStage)) pid=...)`` prefix) to the driver; their stdout lines go
  to the log file, their stderr (a warning, a traceback) still to the terminal.
- C++: the core worker writes to file descriptor 2 directly, so descriptor 2 is read through a pipe
  by a thread that moves the lines of :data:`KNOWN_NOTICES` to the log file and passes every other
  line through unchanged. Only listed notices are moved: an unknown C++ line may be a real error.
  Python's own ``sys.stderr`` (the job's messages, tracebacks) bypasses the pipe, straight to the
  terminal, so nothing the job says can be held in the pipe when the process exits.

``--verbose`` leaves Ray's output as Ray prints it.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
from pathlib import Path

# Ray C++ notices that are not errors (matched as substrings of one line): they go to the log file.
KNOWN_NOTICES = ("has constructor arguments in the object store and max_restarts > 0",)
_RAY_LOGGERS = ("ray", "ray.data")
_CONSOLE_LEVEL = {"ray": logging.ERROR, "ray.data": logging.CRITICAL}   # what still prints (see above)
_RELAY = "ray_print_logs"     # the name of Ray's handler of the actors' lines (ray._private.worker)
_FORMAT = "%(asctime)s\t%(levelname)s %(filename)s:%(lineno)s -- %(message)s"


def ray_log_path(run_id: str) -> Path:
    """Where a run's Ray lines go: the temp directory of the driver's machine (the output directory
    may be an object store, and an overwrite clears its ``_logs/``)."""
    return Path(tempfile.gettempdir()) / "orthrus-logs" / f"ray-{run_id}.log"


class QuietTerminal:
    """Ray's notices to ``path`` for this process (:meth:`start` before Ray starts, :meth:`divert_native`
    once it runs, :meth:`close` before exiting)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._log = None
        self._handler: logging.Handler | None = None
        self._quieted: list[tuple[logging.Handler, int]] = []
        self._terminal_fd: int | None = None      # the original descriptor 2, while it is diverted
        self._saved_stderr = None                 # sys.stderr before the diversion, if it was replaced
        self._reader: threading.Thread | None = None
        self.moved = 0                            # C++ notice lines moved to the log file
        self._relays: list | None = None          # Ray's handlers of the actors' lines, while replaced

    def start(self) -> QuietTerminal:
        """Send the Python loggers' notices to the log file (their errors still print)."""
        import ray.data  # noqa: F401 - configures the ``ray.data`` logger now, so it is not reset later
        from ray._private.log import generate_logging_config

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.path, "a", buffering=1, encoding="utf-8")
        self._handler = logging.StreamHandler(self._log)
        self._handler.setLevel(logging.INFO)
        self._handler.setFormatter(logging.Formatter(_FORMAT))
        generate_logging_config()     # idempotent: Ray's own handlers exist before they are adjusted
        for name in _RAY_LOGGERS:
            logger = logging.getLogger(name)
            for h in logger.handlers:
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                    self._quieted.append((h, h.level))
                    h.setLevel(max(h.level, _CONSOLE_LEVEL[name]))
            logger.addHandler(self._handler)
        return self

    def divert_native(self) -> None:
        """Read descriptor 2 through a filtering pipe (after ``ray.init``: the processes Ray starts
        keep the real descriptor). Python's ``sys.stderr`` moves to a copy of the terminal's."""
        if self._terminal_fd is not None:
            return
        sys.stderr.flush()
        self._terminal_fd = os.dup(2)
        if _writes_to_descriptor_2(sys.stderr):
            # Only a sys.stderr that writes to descriptor 2 moves; one that writes elsewhere (an
            # embedding program's, a test's capture) never reaches the pipe and is left as it is.
            self._saved_stderr = sys.stderr
            sys.stderr = open(os.dup(self._terminal_fd), "w", buffering=1, encoding="utf-8", errors="replace")
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self._reader = threading.Thread(target=self._pump, args=(read, self._terminal_fd), name="orthrus-stderr",
                                        daemon=True)
        self._reader.start()

    def divert_workers(self) -> None:
        """The actors' stdout lines to the log file (after ``ray.init``, which installs Ray's relay);
        their stderr lines go on to Ray's relay, the terminal."""
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        if self._relays is not None:
            return
        self._relays = [h for name, h in dispatcher.handlers if name == _RELAY]
        dispatcher.remove_handler(_RELAY)
        dispatcher.add_handler(_RELAY, self._relay)

    def _relay(self, data: dict) -> None:
        if data.get("is_err"):
            for handler in self._relays:
                handler(data)
            return
        who = data.get("actor_name") or data.get("task_name") or ""
        for line in data.get("lines", []):
            self._log.write(f"({who} pid={data.get('pid')}) {line}\n")

    def _pump(self, read: int, terminal: int) -> None:
        with open(read, "rb") as pipe:
            for line in pipe:      # ends when every copy of the pipe's write end is closed
                text = line.decode("utf-8", "replace")
                if any(n in text for n in KNOWN_NOTICES):
                    self.moved += 1
                    self._log.write(text)
                else:
                    os.write(terminal, line)

    def close(self) -> None:
        """Give descriptor 2 back to the terminal (lines still in the pipe are passed on first) and
        the loggers their handlers."""
        if self._terminal_fd is not None:
            sys.stderr.flush()
            if self._saved_stderr is not None:      # the caller's sys.stderr back, ours closed
                ours, sys.stderr, self._saved_stderr = sys.stderr, self._saved_stderr, None
                ours.close()
            os.dup2(self._terminal_fd, 2)   # closes this process's last write end of the pipe
            if self._reader is not None:
                self._reader.join(timeout=2)   # a child holding a copy keeps it open: do not wait on it
            self._terminal_fd = None
        if self._relays is not None:                # Ray's relay of the actors' lines back
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
            dispatcher.remove_handler(_RELAY)
            for handler in self._relays:
                dispatcher.add_handler(_RELAY, handler)
            self._relays = None
        for h, level in self._quieted:
            h.setLevel(level)
        for name in _RAY_LOGGERS:
            if self._handler is not None:
                logging.getLogger(name).removeHandler(self._handler)
        if self._log is not None:
            self._log.flush()


def _writes_to_descriptor_2(stream) -> bool:
    """Whether ``stream`` is backed by file descriptor 2 (not a capture or an in-memory stream)."""
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False
