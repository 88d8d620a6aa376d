"""Qwen3's chat template ids and the texts of the Qwen3 test model's chains
(``jobs/make_qwen3_test_model.py``), shared by the in-process and the Ray-head vocabulary tests."""
from __future__ import annotations

# Qwen3's ids for the chat template's fixed parts (the released tokenizer's, checked in test_qwen3_vocab.py).
IM_START, USER, ASSISTANT, NL, NL2, THINK, END_THINK = 151644, 872, 77091, 198, 271, 151667, 151668
# What the chains generate, as text (special tokens skipped) and as their first tokens.
IM_END_TEXT = "你好龘🦜世界"          # <|box_start|> between 龘 and 🦜 is skipped
ENDOFTEXT_TEXT = "<tool_call>完成"      # <tool_call> is an added token but not a special one: kept
IM_END_PROMPT = "Say hello<|quad_start|>"
ENDOFTEXT_PROMPT = "Call a tool<|quad_end|>"
