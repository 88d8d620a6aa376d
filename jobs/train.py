"""Train the diffusion view of a Qwen3 or Orthrus checkpoint (docs/design.md §7).

    python -m jobs.train --model models/tiny-orthrus-py --out runs/diff --data stdlib --steps 2000

``--data``: ``stdlib`` (the Python standard library's train split), a Parquet file/dir (text in
``--text-column``), or a directory of text files. Re-running with the same ``--out`` resumes from
its last save. Every ``--eval-every`` steps, held-out greedy tokens per cycle is measured with the
engine on ``--eval-shards`` prompts.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import pyarrow.dataset as pads
import torch
from transformers import AutoTokenizer

from jobs.prompt_ids import load_prompt_ids
from orthrus import OrthrusForCausalLM
from orthrus_train.trainer import DiffusionTrainer, TrainConfig, acceptance, self_generated_rows

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local HF-layout Qwen3 or Orthrus checkpoint directory")
    ap.add_argument("--out", required=True, help="output directory (also the resume point)")
    ap.add_argument("--data", default="stdlib", help="'stdlib', a Parquet file/dir, or a text-file directory")
    ap.add_argument("--text-column", default="text")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-shards", default="examples/shards", help="Parquet prompts (column 'prompt')")
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--self-distill", type=int, default=0,
                    help="add this many of the model's own continuations of corpus prefixes (half greedy)")
    ap.add_argument("--own-fraction", type=float, default=0.5,
                    help="with --self-distill: the share of own continuations among the training rows")
    ap.add_argument("--own-temperature", type=float, default=0.8,
                    help="with --self-distill: the temperature of the sampled half of the continuations")
    ap.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    for field, default in vars(TrainConfig()).items():
        ap.add_argument("--" + field.replace("_", "-"), type=type(default), default=default)
    return ap.parse_args(argv)


def load_texts(data: str, column: str) -> list[str]:
    """Training documents from the named source (fails naming the path when unreadable)."""
    if data == "stdlib":
        from orthrus_train import corpus
        train, _ = corpus.split_files(corpus.list_files())
        return list(corpus.iter_texts(train))
    path = Path(data)
    if not path.exists():
        raise SystemExit(f"--data {data}: no such file or directory")
    if path.suffix == ".parquet" or any(path.glob("*.parquet")):
        return [t for t in pads.dataset(str(path), format="parquet").to_table(columns=[column])
                .column(column).to_pylist() if t]
    return [p.read_text(errors="replace") for p in sorted(path.rglob("*")) if p.is_file()]


def pack(tok, texts: list[str], seq_len: int) -> torch.Tensor:
    """Documents separated by EOS, packed into ``[rows, seq_len]``."""
    sep = tok.eos_token_id if tok.pad_token_id is None else tok.pad_token_id
    stream: list[int] = []
    for ids in tok(texts, add_special_tokens=False)["input_ids"]:
        stream.extend(ids + [sep])
    n = len(stream) // seq_len
    if n == 0:
        raise SystemExit(f"not enough text for one {seq_len}-token row")
    return torch.tensor(stream[: n * seq_len]).view(n, seq_len)


def eval_prompts(tok, shards: str, n: int) -> list[list[int]]:
    if n <= 0 or not Path(shards).exists():
        return []
    return load_prompt_ids(tok, shards, n)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(**{f: getattr(args, f) for f in vars(TrainConfig())})
    out = Path(args.out)
    resume_from = out if (out / "train_state.pt").is_file() else Path(args.model)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = OrthrusForCausalLM.from_pretrained(str(resume_from), dtype=torch.float32)
    rows = pack(tok, load_texts(args.data, args.text_column), args.seq_len)
    if args.self_distill:
        # generated from the frozen AR view: the same rows whether or not the run resumed
        own = self_generated_rows(model, rows, args.self_distill, 64, 192, args.seq_len, seed=cfg.seed,
                                  temperature=args.own_temperature)
        corpus_rows = round(own.shape[0] * (1 - args.own_fraction) / max(args.own_fraction, 1e-9))
        rows = torch.cat([rows[torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(cfg.seed))
                               [:corpus_rows]], own])
    prompts = eval_prompts(tok, args.eval_shards, args.eval_prompts)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(args.model) / name).is_file() and Path(args.model).resolve() != out.resolve():
            shutil.copy(Path(args.model) / name, out / name)
    log_file = (out / "train.log").open("a")

    def log(line: str) -> None:
        print(line, file=log_file, flush=True)
    trainer = DiffusionTrainer(model, rows, cfg, str(out), prompts, log, getattr(torch, args.save_dtype))
    if trainer.resume():
        log(f"resumed at step {trainer.step_no}")
    log(f"rows={tuple(rows.shape)} config={cfg}")
    if prompts and trainer.step_no == 0:
        log('{"step": 0, "eval": %s}' % acceptance(model, prompts, cfg.block_size))
    trainer.run()
    final = trainer.evaluate()
    log(f"final eval {final}")
    print(f"done at step {trainer.step_no}; held-out {final}", file=sys.stderr)


if __name__ == "__main__":
    main()
