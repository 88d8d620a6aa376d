"""Turn one input row (prompt and/or messages) into prompt text, raising :class:`RowError` if it cannot."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.config import PromptConfig
from pipeline.requests.errors import RowError


class InvalidText:
    """Stands in for a cell whose bytes are not valid UTF-8 (Arrow does not check on read), or of a
    column whose type Python cannot hold (``utf8=False``)."""

    def __init__(self, column: str, error: str, utf8: bool = True) -> None:
        self.column, self.error, self.utf8 = column, error, utf8

    def message(self) -> str:
        """Its row's error: invalid UTF-8 (``utf8``), or a column of a type that cannot be read."""
        if self.utf8:
            return f"column {self.column!r} is not valid UTF-8 ({self.error})"
        return f"column {self.column!r} {self.error}"

    def raise_row_error(self) -> None:
        """Turn the bad cell into its row's error."""
        raise RowError(self.message())


def _check_text(text: str, what: str) -> None:
    """Reject text the tokenizer cannot take: lone surrogates (e.g. from a JSON '\\ud800' escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowError(f"{what} is not valid Unicode: {e.reason} at position {e.start}") from None


@dataclass(frozen=True)
class ChatTemplate:
    """How rows become prompt text: whether to apply a chat template, which one, with what arguments."""

    use: Literal["auto", "on", "off"] = "auto"   # 'auto': if the tokenizer (or ``template``) has one
    template: str | None = None                 # a Jinja template replacing the tokenizer's own
    kwargs: tuple[tuple[str, Any], ...] = ()    # extra template variables, e.g. (("enable_thinking", False),)

    @classmethod
    def of(cls, cfg: PromptConfig) -> "ChatTemplate":
        """The job's ``prompt`` section."""
        kwargs = () if cfg.enable_thinking is None else (("enable_thinking", cfg.enable_thinking),)
        return cls(cfg.chat_template, None, kwargs)


def uses_chat_template(cfg: ChatTemplate, tokenizer) -> bool:
    """Whether prompts go through a chat template ('auto' = if there is one)."""
    if cfg.use == "auto":
        return bool(cfg.template or getattr(tokenizer, "chat_template", None))
    return cfg.use == "on"


def _messages(value: Any) -> list[dict[str, str]]:
    """Validate chat messages (list of {role, content}, or that as a JSON string)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError(f"messages is not valid JSON: {e}") from None
        except (ValueError, RecursionError, MemoryError) as e:   # legal JSON Python cannot hold:
            # a number over the int-digit limit, nesting deeper than the recursion limit
            raise RowError(f"messages is JSON this job cannot read: {type(e).__name__}: {e}"[:300]) from None
    if not isinstance(value, list) or not value:
        raise RowError("messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowError(f"messages[{i}] must have string 'role' and 'content', got {m!r}"[:300])
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in out):
        raise RowError("messages have no content (every message is empty or whitespace-only)")
    return out


def format_prompt(prompt: Any, messages: Any, cfg: ChatTemplate, tokenizer) -> tuple[str, bool]:
    """Prompt text and whether the tokenizer should add its special tokens (raw text only)."""
    for value in (prompt, messages):
        if isinstance(value, InvalidText):
            value.raise_row_error()
    if prompt is not None and not isinstance(prompt, str):
        raise RowError(f"prompt must be a string, got {type(prompt).__name__}")
    if prompt is not None and not prompt.strip() and messages is None:
        # Whitespace is valid text but no prompt: the model would continue from nothing.
        raise RowError("prompt is empty" if not prompt else "prompt is whitespace-only")
    if not uses_chat_template(cfg, tokenizer):
        if prompt is None:
            raise RowError("prompt is missing (messages need prompt.chat_template 'on' or 'auto')")
        _check_text(prompt, "prompt")
        return prompt, True
    if messages is not None:
        msgs = _messages(messages)
    elif prompt:
        msgs = [{"role": "user", "content": prompt}]
    else:
        raise RowError("prompt and messages are both missing")
    try:
        text = tokenizer.apply_chat_template(msgs, chat_template=cfg.template, tokenize=False,
                                             add_generation_prompt=True, **dict(cfg.kwargs))
    except Exception as e:  # jinja errors (e.g. a template rejecting a role) are row problems
        raise RowError(f"chat template failed: {type(e).__name__}: {e}") from None
    _check_text(text, "prompt (after the chat template)")
    return text, False
