"""The diffusion-view training loop: AdamW on the twins, periodic held-out acceptance, resumable.

Progress lives in ``out_dir``: ``train_state.pt`` (step, twins, optimiser, RNG) is written
atomically, so a killed run resumes from its last save; the model itself is saved in the released
layout (``save_pretrained``) beside it.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from orthrus.engine.engine import OrthrusEngine
from orthrus.model.qwen3 import OrthrusForCausalLM
from orthrus.metrics import acceptance_by_position, tokens_per_cycle
from orthrus.params import SamplingParams
from orthrus_train.training import distill_loss, freeze_all_but_diffusion, sample_anchors

STATE = "train_state.pt"


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one diffusion-view training run."""

    steps: int = 1000
    batch_size: int = 4
    anchors: int = 32            # anchors (blocks) per sequence
    block_size: int = 16         # the largest block; saved as the model's block_size
    min_block_size: int = 0      # >0: each step draws K from the powers of two in [min, block_size],
                                 # so the twins also serve smaller blocks (cheaper cycles)
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    seed: int = 0
    eval_every: int = 200
    save_every: int = 100
    max_minutes: float = 0.0     # 0 = no wall-clock budget


def acceptance(model: OrthrusForCausalLM, prompts: list[list[int]], block_size: int, max_new_tokens: int = 64,
               temperature: float = 0.0, batch: int = 16) -> dict:
    """Token-weighted tokens per cycle of the speculative engine on ``prompts``, with the summed
    accept-length histogram and per-position acceptance (P(draft i accepted | drafts < i accepted))."""
    engine = OrthrusEngine(model, max_batch_size=min(batch, len(prompts)), block_size=block_size)
    params = [SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=i)
              for i in range(len(prompts))]
    res = engine.generate(prompts, params)
    cycles = sum(r.stats.num_cycles for r in res)
    accepted = sum(r.stats.num_accepted_draft_tokens for r in res)
    hist = [sum(col) for col in zip(*(r.stats.accept_length_histogram for r in res))]
    per_pos = acceptance_by_position(hist)[1]
    return {"tokens_per_cycle": tokens_per_cycle(accepted, cycles), "cycles": cycles,
            "tokens": sum(len(r.token_ids) for r in res), "block_size": block_size, "temperature": temperature,
            "accept_length_histogram": hist, "per_position_acceptance": [round(x, 4) for x in per_pos]}


def self_generated_rows(model: OrthrusForCausalLM, rows: torch.Tensor, count: int, prompt_len: int,
                        new_tokens: int, seq_len: int, seed: int = 0, batch: int = 64,
                        temperature: float = 0.8) -> torch.Tensor:
    """Packed rows ``[n, seq_len]`` of the model's own continuations of corpus prefixes.

    At inference the diffusion view drafts after the model's *own* output, which for a small model
    is far more repetitive than human text; distilling on those continuations (half greedy, half
    sampled at ``temperature``) trains it on the prefixes it will actually see.
    """
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, rows.shape[0], (count,), generator=g)
    prompts = [rows[i, :prompt_len].tolist() for i in idx]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else temperature, max_new_tokens=new_tokens,
                             seed=seed + i)
              for i in range(count)]
    engine = OrthrusEngine(model, max_batch_size=batch, max_seq_len=prompt_len + new_tokens + 1)
    stream: list[int] = []
    for prompt, res in zip(prompts, engine.generate(prompts, params, speculative=False)):
        stream.extend(prompt + res.token_ids)
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len]).view(n, seq_len)


class DiffusionTrainer:
    """Trains the ``*_diff`` twins of ``model`` on packed token rows ``[n, T]``."""

    def __init__(self, model: OrthrusForCausalLM, rows: torch.Tensor, cfg: TrainConfig, out_dir: str,
                 eval_prompts: list[list[int]] | None = None, log: Callable[[str], None] = print,
                 save_dtype: torch.dtype | None = None) -> None:
        self.model, self.rows, self.cfg, self.out = model, rows, cfg, Path(out_dir)
        self.save_dtype = save_dtype
        self.eval_prompts, self.log = eval_prompts or [], log
        self.params = freeze_all_but_diffusion(model)
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.step_no = 0
        model.config.block_size = cfg.block_size

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10% of the peak."""
        c = self.cfg
        if step < c.warmup:
            return c.lr * (step + 1) / c.warmup
        frac = (step - c.warmup) / max(1, c.steps - c.warmup)
        return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    def resume(self) -> bool:
        """Load ``train_state.pt`` from ``out_dir`` if present; True when resumed."""
        path = self.out / STATE
        if not path.is_file():
            return False
        state = torch.load(path, map_location="cpu", weights_only=False)
        with torch.no_grad():
            for p, saved in zip(self.params, state["twins"]):
                p.copy_(saved)
        self.opt.load_state_dict(state["optimizer"])
        self.gen.set_state(state["rng"])
        self.step_no = state["step"]
        return True

    def save(self) -> None:
        """Atomically write the training state, then the model in the released layout."""
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / (STATE + ".tmp")
        torch.save({"step": self.step_no, "twins": [p.detach() for p in self.params],
                    "optimizer": self.opt.state_dict(), "rng": self.gen.get_state(),
                    "config": asdict(self.cfg)}, tmp)
        os.replace(tmp, self.out / STATE)
        self.model.save_pretrained(str(self.out), dtype=self.save_dtype)

    def train_step(self) -> dict[str, float]:
        """One optimiser step on a random batch of rows with fresh random anchors."""
        c = self.cfg
        idx = torch.randint(0, self.rows.shape[0], (c.batch_size,), generator=self.gen)
        tokens = self.rows[idx]
        anchors = sample_anchors(c.batch_size, tokens.shape[1], c.anchors, self.gen)
        sizes = [k for k in (1 << i for i in range(1, 12)) if c.min_block_size <= k < c.block_size] + [c.block_size]
        k = sizes[int(torch.randint(0, len(sizes), (1,), generator=self.gen))] if c.min_block_size else c.block_size
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(self.step_no)
        self.model.train()
        loss, stats = distill_loss(self.model, tokens, anchors, k)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.step_no += 1
        return {"loss": stats.loss, "top1": stats.top1_agreement, "block_size": k}

    def evaluate(self) -> dict[str, float]:
        """Held-out greedy tokens per cycle with the engine (empty dict without eval prompts)."""
        if not self.eval_prompts:
            return {}
        self.model.eval()
        return acceptance(self.model, self.eval_prompts, self.cfg.block_size)

    def run(self, progress: bool = True) -> dict[str, float]:
        """Train until ``steps`` or the wall-clock budget; save and evaluate along the way."""
        from tqdm import tqdm
        c, start, last = self.cfg, time.time(), {}
        bar = tqdm(total=c.steps, initial=self.step_no, disable=not progress, desc="diffusion view")
        while self.step_no < c.steps:
            last = self.train_step()
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.3f}", top1=f"{last['top1']:.2f}")
            if self.step_no % 10 == 0:
                self.log(json.dumps({"step": self.step_no, **last, "lr": self.lr_at(self.step_no)}))
            if self.step_no % c.save_every == 0:
                self.save()
            if c.eval_every and self.step_no % c.eval_every == 0:
                self.log(json.dumps({"step": self.step_no, "eval": self.evaluate()}))
            if c.max_minutes and time.time() - start > 60 * c.max_minutes:
                self.log(f"wall-clock budget of {c.max_minutes} min reached at step {self.step_no}")
                break
        bar.close()
        self.save()
        return last
