"""Training corpus for the bundled tiny model: the Python standard library's own source.

Why the stdlib: it is on every machine (no downloads are possible here), it is real, idiomatic
Python, and it is large enough (~20 MB) to teach a few-million-parameter model what code looks
like. Files are split into train / held-out by a hash of their relative path, so the split is the
same on every machine and every run, and held-out files (the source of the evaluation prompts)
never leak into training.

No Ray imports here: this module belongs to the ``orthrus`` package.
"""
from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

# Directory names skipped anywhere in a path. Tests are excluded because they are huge, repetitive
# and mostly assertion boilerplate; the rest are vendored/legacy/generated code or data.
EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__",
    "test", "tests", "idle_test", "idlelib", "lib2to3", "pydoc_data", "ensurepip",
    "turtledemo", "__phello__", "encodings",  # encodings: mostly generated charmap tables
})
# Anything bigger is generated data (pydoc topics, unicode tables) rather than code people write.
MAX_FILE_BYTES = 200_000
# Held-out share, in thousandths of the hash space (70 -> ~7% of files; chosen so the held-out
# files yield >= 200 documented functions for the evaluation prompts).
HELDOUT_PER_MILLE = 70

CHAT_INSTRUCTION = "Complete this function:\n"


def stdlib_dir() -> Path:
    """The running interpreter's pure-Python standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str) -> bool:
    """Deterministic split: a file is held out iff a hash of its relative path lands in the
    first HELDOUT_PER_MILLE thousandths. Hashing the *path* (not the content) keeps the split
    stable across Python patch releases whose file contents differ slightly."""
    digest = hashlib.sha1(rel_path.replace(os.sep, "/").encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELDOUT_PER_MILLE


def _excluded(rel: Path) -> bool:
    parts = rel.parts
    if any(p in EXCLUDED_DIRS or p.startswith("config-") for p in parts[:-1]):
        return True
    # Top-level test helpers living outside test/ (e.g. `test_support`-style files).
    return parts[-1].startswith("test_")


def list_files(root: Path | None = None) -> list[str]:
    """All usable stdlib .py files as sorted POSIX paths relative to ``root``."""
    root = Path(root) if root is not None else stdlib_dir()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _excluded(rel) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(rel.as_posix())
    return sorted(out)


def split_files(files: Iterable[str]) -> tuple[list[str], list[str]]:
    """(train, heldout) lists, each sorted."""
    train, held = [], []
    for f in sorted(files):
        (held if is_heldout(f) else train).append(f)
    return train, held


def read_source(rel: str, root: Path | None = None) -> str | None:
    """File text, or None if it is not valid UTF-8 (a handful of stdlib files use latin-1)."""
    root = Path(root) if root is not None else stdlib_dir()
    try:
        text = (root / rel).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    # Normalise line endings so that tokenization is identical on every platform.
    return text.replace("\r\n", "\n")


def iter_texts(files: Sequence[str], root: Path | None = None) -> Iterator[str]:
    """Yield each readable, non-empty file's text, in the given order."""
    for rel in files:
        text = read_source(rel, root)
        if text and text.strip():
            yield text


# --------------------------------------------------------------------------------------------
# Function-level examples (chat-style training data and held-out evaluation prompts)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FunctionExample:
    """A function split into its prompt (signature + docstring) and the body that follows."""
    source: str      # "relative/path.py:Qualified.name"
    lineno: int      # line of the `def` in the file (for stable ids only)
    prompt: str      # dedented signature + docstring, ending in "\n"
    body: str        # dedented remainder of the function (statements after the docstring)

    @property
    def uid(self) -> str:
        """Stable short id derived from file, qualified name and line."""
        key = f"{self.source}:{self.lineno}".encode("utf-8")
        return "stdlib-" + hashlib.sha1(key).hexdigest()[:16]


def _strip_indent(lines: list[str], indent: int) -> list[str]:
    # Remove exactly the def's own indentation; lines with less leading whitespace (inside
    # multi-line strings) are kept verbatim rather than corrupted.
    return [ln[indent:] if ln[:indent].strip() == "" else ln for ln in lines]


def _walk_functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Yield (qualified name, node) for every function or method, nested ones included."""
    stack: list[tuple[str, ast.AST]] = [("", tree)]
    while stack:
        prefix, node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    yield name, child
                stack.append((name + ".", child))
            else:
                stack.append((prefix, child))


def function_examples(rel: str, text: str, max_prompt_chars: int = 1200,
                      max_body_chars: int = 2400) -> list[FunctionExample]:
    """Functions of one file that have a docstring and at least one statement after it."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.split("\n")
    out = []
    for qualname, node in _walk_functions(tree):
        if ast.get_docstring(node) is None or len(node.body) < 2:
            continue
        doc = node.body[0]
        if doc.end_lineno is None or node.end_lineno is None:
            continue
        # The def line itself may be continued over several lines; both slices are line-aligned
        # because a docstring statement always ends its line in stdlib code.
        head = _strip_indent(lines[node.lineno - 1: doc.end_lineno], node.col_offset)
        body = _strip_indent(lines[doc.end_lineno: node.end_lineno], node.col_offset)
        prompt = "\n".join(head) + "\n"
        body_text = "\n".join(body) + "\n"
        if not head[0].lstrip().startswith(("def ", "async def ")):
            continue  # e.g. a one-line def with the docstring on the same line
        if len(prompt) > max_prompt_chars or len(body_text) > max_body_chars or not body_text.strip():
            continue
        out.append(FunctionExample(f"{rel}:{qualname}", node.lineno, prompt, body_text))
    out.sort(key=lambda e: e.lineno)
    return out


def chat_messages(ex: FunctionExample) -> list[dict[str, str]]:
    """Chat form of an example: the user asks for the body, the assistant answers with it."""
    return [{"role": "user", "content": CHAT_INSTRUCTION + ex.prompt},
            {"role": "assistant", "content": ex.body}]


def render_chat(messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Plain-Python twin of the bundled ChatML template (used to build training text without
    loading a tokenizer); the tokenizer's Jinja template renders the same string."""
    s = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return s + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def iter_chat_texts(files: Sequence[str], root: Path | None = None,
                    max_per_file: int = 20) -> Iterator[str]:
    """Chat-formatted function-completion examples from ``files`` (use the train split!)."""
    for rel in files:
        text = read_source(rel, root)
        if not text:
            continue
        for ex in function_examples(rel, text)[:max_per_file]:
            yield render_chat(chat_messages(ex))


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------

def pack_sequences(texts: Iterable[str], encode: Callable[[str], list[int]], seq_len: int,
                   sep_id: int) -> Iterator[list[int]]:
    """Concatenate encoded documents, each followed by ``sep_id`` (<|endoftext|>), and cut the
    stream into ``seq_len``-token rows. Packing wastes no compute on padding, which matters on a
    CPU budget; the trailing partial row is dropped."""
    buf: list[int] = []
    for text in texts:
        buf.extend(encode(text))
        buf.append(sep_id)
        while len(buf) >= seq_len:
            yield buf[:seq_len]
            buf = buf[seq_len:]


def build_token_stream(texts: Iterable[str], encode_batch: Callable[[list[str]], list[list[int]]],
                       sep_id: int, batch: int = 64) -> list[int]:
    """Encode all ``texts`` (batched, for tokenizer throughput) into one flat id list with a
    ``sep_id`` after each document."""
    out: list[int] = []
    pending: list[str] = []

    def flush() -> None:
        for ids in encode_batch(pending):
            out.extend(ids)
            out.append(sep_id)
        pending.clear()

    for t in texts:
        pending.append(t)
        if len(pending) >= batch:
            flush()
    if pending:
        flush()
    return out
