"""The driver's quiet terminal (``pipeline/run/terminal.py``), in a child process whose stderr the
test reads: Ray's notices (Python loggers and the listed C++ line), Ray Data's errors (the
traceback of an exception the job reports itself) and the actors' printed lines go to the log
file; Ray's other errors, the actors' stderr, unknown C++ lines and the job's own messages still
reach the terminal, also after ``close``.

The whole job's terminal on a real Ray head: ``tests/e2e/test_observability_ray.py``.
"""
from __future__ import annotations

import subprocess
import sys

from pipeline.run.terminal import KNOWN_NOTICES, QuietTerminal
from support.hang import HANG_S
from support.paths import REPO

NOTICE = (f"[2026-12-04 15:45:39,505 E 7426 7819] core_worker.cc:2465: Actor with class name: 'X' "
          f"{KNOWN_NOTICES[0]}. If the arguments in the object store go out of scope ...")
SCRIPT = """
import logging, os, sys
from pathlib import Path
from ray._private.ray_logging import global_worker_stdstream_dispatcher as relay
from pipeline.run.terminal import QuietTerminal
# what ray.init(log_to_driver=True) installs: the relay of the actors' lines to this terminal
relay.add_handler("ray_print_logs", lambda d: print(*d["lines"], file=sys.stderr if d["is_err"] else sys.stdout))
actor = {"pid": 7, "actor_name": "MapWorker(MapBatches(GenerationStage))", "ip": "", "localhost": ""}
t = QuietTerminal(Path(sys.argv[1])).start()
logging.getLogger("ray").warning("ray python notice")
logging.getLogger("ray.data").warning("Progress bars disabled (ray.data notice)")
logging.getLogger("ray.data._internal.execution").error("ray.data operator traceback")
logging.getLogger("ray").error("ray python error")
t.divert_native()
t.divert_workers()
relay.emit({**actor, "is_err": False, "lines": ["[orthrus] actor: batch of 2 rows"]})
relay.emit({**actor, "is_err": True, "lines": ["an actor's stderr line"]})
os.write(2, (sys.argv[2] + "\\n").encode())          # what Ray's C++ core writes to descriptor 2
os.write(2, b"an unknown native line\\n")
print("the job's own message", file=sys.stderr)
t.close()
os.write(2, b"after close\\n")
relay.emit({**actor, "is_err": False, "lines": ["an actor line after close"]})
print(f"moved {t.moved}")
"""


def test_notices_go_to_the_log_file_errors_and_our_lines_to_the_terminal(tmp_path):
    log = tmp_path / "ray.log"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(log), NOTICE], cwd=REPO, capture_output=True,
                          text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err, logged = proc.stderr, log.read_text()
    for line in ("ray python error", "an unknown native line", "the job's own message", "after close",
                 "an actor's stderr line"):
        assert line in err, err
    for line in ("ray python notice", "ray.data notice", KNOWN_NOTICES[0], "ray.data operator traceback",
                 "[orthrus] actor: batch of 2 rows"):
        assert line not in err + proc.stdout and line in logged, (err, logged)
    assert "(MapWorker(MapBatches(GenerationStage)) pid=7) [orthrus] actor: batch of 2 rows" in logged
    assert "moved 1" in proc.stdout and "an actor line after close" in proc.stdout   # Ray's relay is back


def test_a_stderr_that_is_not_descriptor_2_is_left_alone_and_restored(tmp_path, capsys):
    """An embedding program's (here pytest's) sys.stderr keeps receiving the job's lines."""
    before = sys.stderr
    terminal = QuietTerminal(tmp_path / "ray.log").start()
    terminal.divert_native()
    assert sys.stderr is before
    print("the job's own message", file=sys.stderr)
    terminal.close()
    assert sys.stderr is before and "the job's own message" in capsys.readouterr().err
