"""The held-out prompts as token ids: the one loader the benchmark, evaluation and training share."""
from __future__ import annotations

import pyarrow.dataset as pads


def load_prompt_ids(tokenizer, shards: str, n: int | None = None) -> list[list[int]]:
    """Token ids of the ``prompt`` column of Parquet ``shards`` (completion style, no special tokens)."""
    texts = pads.dataset(shards, format="parquet").to_table(columns=["prompt"]).column("prompt").to_pylist()
    texts = texts if n is None else texts[:n]
    return [ids for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
