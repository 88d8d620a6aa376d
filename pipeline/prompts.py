"""Turn one input row (prompt and/or messages) into prompt text, raising :class:`RowError` if it cannot."""
from __future__ import annotations

import json
from typing import Any

from pipeline.config import PromptConfig


class RowError(ValueError):
    """A problem with one row: it becomes an error row, the job goes on."""


def uses_chat_template(cfg: PromptConfig, tokenizer) -> bool:
    """Whether prompts go through the tokenizer's chat template ('auto' = if it has one)."""
    if cfg.chat_template == "auto":
        return bool(getattr(tokenizer, "chat_template", None))
    return cfg.chat_template == "on"


def _messages(value: Any) -> list[dict[str, str]]:
    """Validate chat messages (list of {role, content}, or that as a JSON string)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError(f"messages is not valid JSON: {e}") from None
    if not isinstance(value, list) or not value:
        raise RowError("messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowError(f"messages[{i}] must have string 'role' and 'content', got {m!r}"[:300])
        out.append({"role": m["role"], "content": m["content"]})
    return out


def format_prompt(prompt: Any, messages: Any, cfg: PromptConfig, tokenizer) -> tuple[str, bool]:
    """Prompt text and whether the tokenizer should add its special tokens (raw text only)."""
    if prompt is not None and not isinstance(prompt, str):
        raise RowError(f"prompt must be a string, got {type(prompt).__name__}")
    if not uses_chat_template(cfg, tokenizer):
        if prompt is None:
            raise RowError("row has no prompt (messages need prompt.chat_template 'on' or 'auto')")
        if not prompt:
            raise RowError("prompt is empty")
        return prompt, True
    if messages is not None:
        msgs = _messages(messages)
    elif prompt:
        msgs = [{"role": "user", "content": prompt}]
    else:
        raise RowError("row has neither a prompt nor messages")
    kwargs = {} if cfg.enable_thinking is None else {"enable_thinking": cfg.enable_thinking}
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as e:  # jinja errors (e.g. a template rejecting a role) are row problems
        raise RowError(f"chat template failed: {type(e).__name__}: {e}") from None
    return text, False
