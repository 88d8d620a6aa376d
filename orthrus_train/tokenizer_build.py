"""Train the bundled model's byte-level BPE tokenizer on the stdlib train split.

The tokenizer mirrors Qwen's design at a tiny scale: Qwen2/3's pre-tokenization regex, byte-level
BPE (so any text round-trips exactly — indentation, tabs, unicode), and the three ChatML special
tokens appended after the learned vocabulary (as in Qwen, where <|endoftext|> = 151643). The mask
token used by the diffusion view is *not* a tokenizer token: like the released Orthrus
checkpoints, it is the embedding row one past the tokenizer's last id.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from orthrus_train import corpus

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
DEFAULT_VOCAB_SIZE = 4096  # including the special tokens

# Qwen2/Qwen3 pre-tokenizer pattern. `\s+(?!\S)` leaves the last space of an indentation run to
# attach to the following word, so "    return" becomes "   " + " return": indentation widths
# become single tokens while words keep their usual leading-space form.
QWEN_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3-style ChatML. `enable_thinking` may be passed (callers written for Qwen3 do) and is
# accepted but ignored: this tiny model has no thinking mode and never saw <think> tags.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE with ``vocab_size`` ids in total (learned merges + 3 specials)."""
    tok = Tokenizer(models.BPE())  # no unk token: byte-level covers every input
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # No normalizer (Qwen applies NFC): any normalisation would break exact round-trips.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Appended after training so they take the last ids, exactly as in Qwen's vocabulary.
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def save_hf_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 2048) -> None:
    """Save as a ``PreTrainedTokenizerFast`` loadable with ``AutoTokenizer.from_pretrained``."""
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,  # would alter code whitespace on decode
        padding_side="left",  # decoder-only generation pads on the left
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out))
    # Keep the template inside tokenizer_config.json (as Qwen3 ships it) rather than in a separate
    # chat_template.jinja, so the config is self-describing.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    jinja = out / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()


def build(out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train on the stdlib train split only and save to ``out_dir``. Chat-formatted text is left
    out on purpose: its literal "<|im_start|>" strings would waste merges on pieces of tokens that
    are special (single ids) in the final tokenizer."""
    train_files, _ = corpus.split_files(corpus.list_files())
    tok = train_tokenizer(corpus.iter_texts(train_files), vocab_size)
    save_hf_tokenizer(tok, out_dir)
    return tok


if __name__ == "__main__":  # python -m orthrus_train.tokenizer_build OUT_DIR
    import sys

    build(sys.argv[1] if len(sys.argv) > 1 else "models/tiny-orthrus-py")
