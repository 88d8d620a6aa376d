"""Where the tests find the repository, the bundled model and the fetched Qwen3 tokenizer."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "models" / "tiny-orthrus-py"          # the bundled model (and its tokenizer)
QWEN3_TOKENIZER_DIR = REPO / ".cache" / "qwen3-tokenizer"    # jobs/fetch_qwen3_tokenizer.sh writes it
VENV_BIN = Path(sys.executable).parent                        # ray, python: the test run's own
