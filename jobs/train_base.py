"""Train the bundled tiny Qwen3 base model (the AR view) from scratch on the stdlib corpus.

    python -m jobs.train_base --out models/tiny-orthrus-py --steps 3000

Builds the tokenizer, packs the train split (whole files + standalone documented functions +
ChatML "complete this function" examples) into fixed-length rows, trains ``Qwen3ForCausalLM``
with AdamW + warmup/cosine on one CPU thread, checkpoints for resumption, then writes an
Orthrus-format directory: config (block_size, mask_token_id, OrthrusLM), generation config,
bf16 safetensors holding the AR weights plus ``*_diff`` twins initialised as copies of the AR
attention weights (the diffusion-view training starts from exactly these), and the tokenizer.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import time
from pathlib import Path

import torch

from orthrus_train import corpus
from orthrus_train.tokenizer_build import ENDOFTEXT, IM_END, build as build_tokenizer

TWIN_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models/tiny-orthrus-py", help="final model directory")
    p.add_argument("--ckpt-dir", default="runs/train_base", help="resumable checkpoints (not committed)")
    p.add_argument("--log", default=None, help="loss log file (default: <out>.train.log)")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop early at this wall time (0 = off)")
    p.add_argument("--stop-step", type=int, default=0,
                   help="stop at this step while keeping the --steps LR schedule (0 = off); replays "
                        "a run that --max-minutes cut short, step for step")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--block-size", type=int, default=16, help="Orthrus draft block size K")
    p.add_argument("--vocab", type=int, default=4096, help="tokenizer vocab incl. specials")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-rows", type=int, default=32, help="held-out rows for periodic eval")
    p.add_argument("--ckpt-every", type=int, default=250)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--reuse-tokenizer", action="store_true", help="use the tokenizer already in --out")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt-dir/last.pt")
    p.add_argument("--no-twins", action="store_true", help="save AR weights only")
    return p.parse_args(argv)


def make_config(args: argparse.Namespace, n_tok: int, tok) -> "Qwen3Config":
    from transformers import Qwen3Config

    # One extra embedding row past the tokenizer's last id is the diffusion view's mask token,
    # as in the released Orthrus checkpoints (mask_token_id = len(tokenizer)).
    eos_ids = [tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)]
    cfg = Qwen3Config(
        vocab_size=n_tok + 1, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=eos_ids[1], eos_token_id=eos_ids, pad_token_id=eos_ids[1],
        attention_dropout=0.0, use_cache=True,
    )
    cfg.block_size = args.block_size
    cfg.mask_token_id = n_tok
    return cfg


def build_rows(tok, files: list[str], seq_len: int, seed: int, chat: bool) -> torch.Tensor:
    """Pack documents into ``[rows, seq_len]``. Document order is shuffled once (seeded) so
    chat/function examples are spread over the whole run rather than bunched at the end."""
    docs = list(corpus.iter_texts(files))
    if chat:
        for rel in files:
            text = corpus.read_source(rel)
            for ex in corpus.function_examples(rel, text or "")[:20]:
                # Standalone function ending in <|endoftext|>: teaches the completion-style
                # eval prompt format (signature + docstring -> body, then stop).
                docs.append(ex.prompt + ex.body)
                docs.append(corpus.render_chat(corpus.chat_messages(ex)))
    random.Random(seed).shuffle(docs)
    sep = tok.convert_tokens_to_ids(ENDOFTEXT)
    stream = corpus.build_token_stream(
        docs, lambda b: tok(b, add_special_tokens=False)["input_ids"], sep)
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def evaluate(model, rows: torch.Tensor, batch: int) -> float:
    """Mean next-token loss (nats/token) over ``rows``."""
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(rows), batch):
        x = rows[i: i + batch]
        out = model(input_ids=x, labels=x)
        k = x.numel() - x.shape[0]  # labels are shifted by one inside the model
        tot += out.loss.item() * k
        n += k
    model.train()
    return tot / max(1, n)


def save_final(model, tok, args: argparse.Namespace, meta: dict) -> None:
    """Write the Orthrus-format directory: bf16 safetensors (+ twins), configs, tokenizer."""
    from transformers import GenerationConfig

    from orthrus.model.checkpoint import write_checkpoint

    out = Path(args.out)
    state = dict(model.state_dict())
    if not args.no_twins:
        for k in list(state):
            mod, _, leaf = k.rpartition(".")
            parent, _, name = mod.rpartition(".")
            if name in TWIN_NAMES and parent.endswith("self_attn"):
                state[f"{parent}.{name}_diff.{leaf}"] = state[k].clone()
    write_checkpoint(out, model.config, state, dtype=torch.bfloat16)
    cfg = model.config
    gen = GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                           pad_token_id=cfg.pad_token_id, do_sample=False, max_new_tokens=256)
    gen.save_pretrained(str(out))
    (out / "training_meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # the other core belongs to other jobs on this machine
    torch.manual_seed(args.seed)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tqdm import tqdm
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    out = Path(args.out)
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    log_path = Path(args.log or f"{args.out.rstrip('/')}.train.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "a", buffering=1)

    def say(msg: str) -> None:
        log.write(msg + "\n")
        tqdm.write(msg)

    resume_path = ckpt_dir / "last.pt"
    if not (args.reuse_tokenizer or args.resume) or not (out / "tokenizer.json").exists():
        build_tokenizer(out, args.vocab)
    tok = AutoTokenizer.from_pretrained(str(out))
    n_tok = len(tok)

    files = corpus.list_files()
    train_files, held_files = corpus.split_files(files)
    train_rows = build_rows(tok, train_files, args.seq_len, args.seed, chat=True)
    held_rows = build_rows(tok, held_files, args.seq_len, args.seed, chat=False)
    say(f"# cmd: python -m jobs.train_base {shlex.join(sys.argv[1:] if argv is None else argv)}")
    say(f"# files train={len(train_files)} heldout={len(held_files)}; rows train={len(train_rows)} "
        f"heldout={len(held_rows)} x {args.seq_len} tokens; vocab={n_tok}")

    cfg = make_config(args, n_tok, tok)
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"# params {n_params/1e6:.2f}M (tied embeddings counted once)")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    step, epoch, elapsed_before = 0, 0, 0.0
    g = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train_rows), generator=g)
    pos = 0
    if args.resume and resume_path.exists():
        ck = torch.load(resume_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, epoch, pos, order = ck["step"], ck["epoch"], ck["pos"], ck["order"]
        g.set_state(ck["gen_state"])
        elapsed_before = ck.get("elapsed", 0.0)
        say(f"# resumed at step {step}")

    def checkpoint() -> None:
        tmp = resume_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "epoch": epoch, "pos": pos, "order": order, "gen_state": g.get_state(),
                    "elapsed": elapsed_before + time.time() - t0}, tmp)
        os.replace(tmp, resume_path)  # atomic: a crash mid-save never corrupts the last checkpoint

    model.train()
    t0 = time.time()
    ema = None
    bar = tqdm(total=args.steps, initial=step, desc="train", dynamic_ncols=True, mininterval=5)
    while step < args.steps:
        if args.max_minutes and (elapsed_before + time.time() - t0) / 60 > args.max_minutes:
            say(f"# wall-clock budget reached at step {step}")
            break
        if args.stop_step and step >= args.stop_step:
            say(f"# --stop-step reached at step {step}")
            break
        if pos + args.batch > len(order):
            epoch += 1
            order, pos = torch.randperm(len(train_rows), generator=g), 0
        x = train_rows[order[pos: pos + args.batch]]
        pos += args.batch
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}")
        if step % args.log_every == 0:
            el = elapsed_before + time.time() - t0
            say(f"step {step} epoch {epoch} loss {loss.item():.4f} ema {ema:.4f} "
                f"lr {lr_at(step - 1, args):.2e} gnorm {gnorm:.2f} elapsed {el/60:.1f}m")
        if step % args.eval_every == 0:
            say(f"eval step {step} heldout_loss {evaluate(model, held_rows[: args.eval_rows], args.batch):.4f}")
        if step % args.ckpt_every == 0:
            checkpoint()
    bar.close()
    checkpoint()
    elapsed = elapsed_before + time.time() - t0
    held = evaluate(model, held_rows, args.batch)
    say(f"final step {step} train_ema_loss {ema} heldout_loss {held:.4f} "
        f"heldout_ppl {math.exp(held):.2f} elapsed {elapsed/60:.1f}m")
    meta = {"steps": step, "epochs_completed": epoch, "train_ema_loss": ema, "heldout_loss": held,
            "heldout_ppl": math.exp(held), "elapsed_minutes": elapsed / 60,
            "train_rows": len(train_rows), "heldout_rows": len(held_rows), "seq_len": args.seq_len,
            "batch": args.batch, "params": n_params, "args": vars(args)}
    save_final(model, tok, args, meta)
    say(f"# saved {out}")


if __name__ == "__main__":
    main()
