"""``python -m jobs.bench [workload] [options]``: see ``jobs/bench/common.py`` (``--help``)."""
from jobs.bench import main

main()
