"""Write the held-out evaluation prompt shards bundled with the repo.

    python -m jobs.make_examples --tokenizer models/tiny-orthrus-py --out examples/shards

Every prompt comes from a HELD-OUT stdlib file (never trained on): a documented function's
signature + docstring, asking for its body. Columns:

- ``id``        stable string id (hash of file, qualified name, line)
- ``prompt``    completion-style raw code: signature + docstring + "\\n". It ends at the newline,
                not after the body's indentation, because the tokenizer merges indentation with
                the first word (" return" after "   "); a prompt ending in spaces would start the
                body on a token boundary the model never saw in training.
- ``messages``  the same request as a chat (list of {role, content}) for ChatML prompting
- ``source``    "path/in/stdlib.py:Qualified.name"
- ``reference`` the original body (for quality checks; never fed to the model)
"""
from __future__ import annotations

import argparse
from pathlib import Path

from orthrus_train import corpus


def collect(tokenizer_dir: str, max_prompt_tokens: int, max_per_file: int) -> list[dict]:
    """Held-out function prompts, deterministic order (sorted by id)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    _, held = corpus.split_files(corpus.list_files())
    rows: dict[str, dict] = {}
    for rel in held:
        text = corpus.read_source(rel)
        if not text:
            continue
        kept = 0
        for ex in corpus.function_examples(rel, text):
            if kept >= max_per_file:  # keep a few big files (pydoc) from dominating the set
                break
            messages = [{"role": "user", "content": corpus.CHAT_INSTRUCTION + ex.prompt}]
            chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            if max(len(tok(ex.prompt)["input_ids"]), len(tok(chat)["input_ids"])) > max_prompt_tokens:
                continue
            rows.setdefault(ex.uid, {"id": ex.uid, "prompt": ex.prompt, "messages": messages,
                                     "source": ex.source, "reference": ex.body})
            kept += 1
    return [rows[k] for k in sorted(rows)]


def write_shards(rows: list[dict], out_dir: str | Path, n_shards: int) -> list[Path]:
    """Contiguous slices of ``rows`` as ``part-0000N.parquet`` (stale parts are removed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*.parquet"):
        old.unlink()
    msg_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("messages", msg_type),
                        ("source", pa.string()), ("reference", pa.string())])
    paths = []
    per = -(-len(rows) // n_shards)
    for i in range(n_shards):
        part = rows[i * per: (i + 1) * per]
        table = pa.Table.from_pylist(part, schema=schema)
        path = out / f"part-{i:05d}.parquet"
        pq.write_table(table, path, compression="zstd")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default="models/tiny-orthrus-py")
    p.add_argument("--out", default="examples/shards")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--max-prompt-tokens", type=int, default=300)
    p.add_argument("--max-per-file", type=int, default=30)
    args = p.parse_args(argv)
    rows = collect(args.tokenizer, args.max_prompt_tokens, args.max_per_file)
    paths = write_shards(rows, args.out, args.shards)
    print(f"{len(rows)} prompts from {len({r['source'].split(':')[0] for r in rows})} held-out files "
          f"-> {len(paths)} shards in {args.out}")


if __name__ == "__main__":
    main()
