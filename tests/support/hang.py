"""The one bound of the tests' waits on another process or a timer: a hang guard, never a speed check."""

# The bound of every wait in the tests (a subprocess, a job, a head's start, a row timeout that must
# not fire). Beside two CPU-burning processes on this 2-core machine a single small job once took 6-7
# minutes (2026-12-07), a bound of a few minutes failed a test that was merely slow, and a probe
# importing torch outran 120 s beside a loaded run (2026-12-07): what has not ended in HANG_S is
# stuck. Ordering between processes is by barriers (fault injection's ``hold_after``, the lease),
# never by this bound.
HANG_S = 1800
