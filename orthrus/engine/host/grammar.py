"""Grammar masks of constrained rows, host side: compiled once per constraint, one matcher per slot
(the device applies them: ``device/masks.py``).

Built on llguidance (a Rust grammar engine with Python bindings and no further dependencies). It
compiles a JSON schema in about a millisecond, computes a next-token mask in microseconds to a
fraction of a millisecond at Qwen3's 151,936 tokens, and has the primitive speculation needs:
masks along a drafted path, the matcher advanced through the drafts up to the first one the grammar
refuses and rolled back (``fill_next_token_bitmask_par_with_draft_tokens``).

Mask layout (llguidance's): ``W = ceil(V / 32)`` int32 words per position; bit ``t % 32`` of word
``t // 32`` set = token ``t`` allowed. All-ones (-1) words = unconstrained. Shape legend: ``n`` rows
of one forward, ``K`` block size, ``W`` words.

Per-row Python here is bounded by the constrained rows of an iteration: a grammar matcher is a host
object per row, and rows without a constraint never reach this module.
"""
from __future__ import annotations

import functools
import json
import re
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.hf
import llguidance.numpy as llnp
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from orthrus.constraints import Constraint, ConstraintError, parse_constraint
from orthrus.engine.host.grammar_limits import check_limits
from orthrus.ranges import named_range

COMPILED_CACHE = 256      # distinct constraints kept compiled per engine (least recently used dropped)
# JSON is laid out as ``json.dumps`` does (", " and ": ", no other whitespace): llguidance's default
# allows any whitespace between tokens, and a model that likes newlines then spends its whole token
# budget on them. A schema's own "x-guidance" options (e.g. {"whitespace_flexible": true}) override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@functools.lru_cache(maxsize=1)
def shared_executor() -> llguidance.LLExecutor:
    """The process's one llguidance thread pool, built at the first constrained mask.

    One per process, not per engine: a pool holds ~0.8 x CPUs threads for the life of the process,
    and a process (a test run, an actor that rebuilds its engine) may build many engines."""
    return llguidance.LLExecutor()


def words(vocab_size: int) -> int:
    """Mask words per position for a vocabulary of ``vocab_size``."""
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Constraint → a matcher in its start state; each distinct constraint is compiled once (a cache)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        # The grammar's end is the model's end-of-sequence: a complete grammar allows these tokens only.
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.words, self.eos = words(vocab_size), np.asarray(eos_token_ids, dtype=np.int64)
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()

    def matcher(self, c: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for ``c``; :class:`ConstraintError` (a ``ValueError``) naming
        ``structured.<kind>`` if it does not compile, would exceed the grammar engine's limits
        (``grammar_limits.py``) or admits no non-empty text."""
        proto = self._compiled.get(c)
        if proto is None:
            check_limits(c)
            proto = llguidance.LLMatcher(self.tokenizer, _grammar(c), log_level=0)
            if proto.is_error():
                raise ConstraintError(c.field, f"does not compile: {proto.get_error()}")
            self._check_start(c, proto)
            self._compiled[c] = proto
            if len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(c)
        return proto.deep_copy()

    def _check_start(self, c: Constraint, proto: llguidance.LLMatcher) -> None:
        """The first token's mask, on a copy: a grammar that fails there, or that allows only the end
        (its language is empty or holds only the empty text), is refused now, not at its first step."""
        probe, mask = proto.deep_copy(), np.zeros((1, self.words), dtype=np.int32)
        llnp.fill_next_token_bitmask(probe, mask, 0)
        if probe.is_error() and not _only_end(mask[0], self.eos):
            raise ConstraintError(c.field, f"fails at its first token: {first_line(probe.get_error())}")
        if _only_end(mask[0], self.eos):
            what = "JSON value" if c.kind == "json_schema" else "text but the empty one"
            raise ConstraintError(c.field, f"admits no {what}: its grammar can only end at once")


def first_line(error: str) -> str:
    """llguidance's error message without the parser state dump that follows it; the dump's item
    count is kept (after a rollback the message itself is only "parser error")."""
    line = error.strip().splitlines()[0][:500] if error.strip() else "unknown error"
    items = re.search(r'"all_items": (\d+)', error)
    return f"{line} (parse items: {items.group(1)})" if items and "items" not in line else line


def _only_end(words_: np.ndarray, eos: np.ndarray) -> bool:
    """Whether a mask ``[W]`` allows nothing but end tokens (or nothing at all)."""
    bits = words_.view(np.uint32).copy()
    for t in eos.tolist():   # SYNC: none (host numpy, a few ids)
        bits[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
    return not bits.any()


def _grammar(c: Constraint) -> str:
    """llguidance's grammar text for a constraint (never raises: errors surface in the matcher)."""
    if c.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(c.spec, defaults=JSON_LAYOUT)
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.spec)
    if c.kind == "choice":   # Lark string literals take JSON's escapes
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in json.loads(c.spec)))
    try:
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(c.spec))
    except Exception as e:   # the GBNF converter raises on text it cannot read
        raise ConstraintError(c.field, f"is neither a Lark nor a GBNF grammar: {e}") from None


class SlotGrammars:
    """The matchers of the constrained slots and each one's mask for its next token (host numpy).

    A slot's matcher has consumed exactly the tokens the host has recorded for its row
    (``consumed``); ``first[slot]`` is the mask after them, the one the row's next iteration needs
    before it starts (unconstrained slots keep all-ones).

    A constrained row in its reasoning phase (``thinking``) writes free text, EOS excluded, until
    its think end; its grammar starts at the token after it, from its start state (vLLM's and
    SGLang's rule). ``consumed`` then counts the reasoning tokens too.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], num_slots: int,
                 think_end: int | None = None) -> None:
        """``tokenizer``: the engine's (an HF tokenizer), or None: then no request may be constrained.
        ``think_end``: the token that ends a reasoning phase (None: no request reasons)."""
        self._tokenizer, self._eos, self.think_end = tokenizer, tuple(eos_token_ids), think_end
        self._compiler: GrammarCompiler | None = None    # built at the first constraint (~1 s at 151k tokens)
        self.vocab_size, self.words = vocab_size, words(vocab_size)
        self.matchers: list[llguidance.LLMatcher | None] = [None] * num_slots
        self.fields: list[str | None] = [None] * num_slots     # each slot's ``structured.<kind>``
        self.failed: dict[int, str] = {}     # slots whose matcher failed, and why: their rows end in error
        self.constrained = np.zeros(num_slots, dtype=bool)
        self.consumed = np.zeros(num_slots, dtype=np.int64)
        self.first = np.full((num_slots, self.words), -1, dtype=np.int32)     # [B, W]
        self.thinking = np.zeros(num_slots, dtype=bool)     # constrained, and its grammar not started yet
        # The mask of a reasoning position: any token but EOS (an answer must follow the thinking).
        self.free = np.full(self.words, -1, dtype=np.int32)
        for t in self._eos:
            self.free.view(np.uint32)[t // 32] &= ~np.uint32(1 << (t % 32))

    def matcher(self, c: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for ``c`` (compiled once per distinct constraint); ``ValueError`` naming
        ``structured.<kind>`` if it does not compile (so ``check_request`` calls this at add time)."""
        if self._tokenizer is None:
            raise ValueError("SamplingParams.structured needs a tokenizer: build the engine with "
                             "OrthrusEngine(..., tokenizer=...)")
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer, self.vocab_size, self._eos)
        return self._compiler.matcher(c)

    @named_range("host_matcher_admit")
    def admit(self, slots: np.ndarray, constraints: Sequence[Constraint | None],
              thinking: Sequence[bool]) -> np.ndarray | None:
        """Seat a fresh matcher in each slot whose row has a constraint (``thinking``: the row starts
        in its reasoning phase) → the first-token masks ``[n, W]`` of all the ``slots`` (None when
        none is constrained)."""
        seated = [(s, c, t) for s, c, t in zip(slots.tolist(), constraints, thinking) if c is not None]  # SYNC: none (host numpy)
        for slot, c, think in seated:
            m = self.matcher(c)
            self.matchers[slot], self.fields[slot], self.constrained[slot], self.consumed[slot] = m, c.field, True, 0
            self.thinking[slot] = think
            if think:
                self.first[slot] = self.free
            else:
                llnp.fill_next_token_bitmask(m, self.first, slot)
                self._check(slot)
        return self.first[slots] if seated else None

    def _check(self, slot: int) -> bool:
        """Whether the slot's matcher is sound; one that entered llguidance's error state (a limit
        no check at add time could foresee) fails its own row only: the slot is unconstrained from
        here on (all-ones masks, so its arithmetic stays finite beside the others) and the engine
        ends the row with finish reason "error" after this iteration."""
        m = self.matchers[slot]
        if m is None or not m.is_error():
            return True
        self.failed[slot] = (f"SamplingParams.{self.fields[slot]}: the grammar engine failed after "
                             f"{self.consumed[slot]} generated token(s): {first_line(m.get_error())}")
        self.matchers[slot], self.constrained[slot] = None, False
        self.first[slot] = -1
        return False

    def take_failed(self) -> dict[int, str]:
        """The slots whose matcher failed since the last call, and why (then forgotten)."""
        failed, self.failed = self.failed, {}
        return failed

    def release(self, slot: int) -> None:
        """The slot's row ended: forget its matcher."""
        self.matchers[slot], self.fields[slot], self.constrained[slot] = None, None, False
        self.thinking[slot] = False
        self.first[slot] = -1

    def reset(self) -> None:
        """Every slot unconstrained (the compiled constraints stay cached)."""
        self.matchers = [None] * len(self.matchers)
        self.fields = [None] * len(self.fields)
        self.failed = {}
        self.constrained[:] = False
        self.thinking[:] = False
        self.first[:] = -1

    def any(self, slots: np.ndarray) -> bool:
        """Whether any of ``slots`` is constrained (host numpy)."""
        return bool(self.constrained[slots].any())

    def awaiting_first(self, slots: np.ndarray, count: np.ndarray) -> np.ndarray:
        """``[n]`` bool: constrained rows whose first token (sampled by their prefill) the host has not
        read yet (``count``: tokens recorded per slot); their masks cannot be computed before it."""
        return self.constrained[slots] & (count[slots] == 0)

    @named_range("host_matcher_advance")
    def advance(self, slots: np.ndarray, generated) -> None:
        """Feed each constrained slot's newly recorded tokens (``generated(slot)``: all of its row's
        tokens so far) to its matcher, then recompute the first masks of those still running."""
        todo = []
        for slot in slots[self.constrained[slots]].tolist():  # SYNC: none (host numpy)
            tokens = generated(slot)
            new = tokens[self.consumed[slot]:].tolist()   # SYNC: none (host numpy)
            if self.thinking[slot]:
                new = self._skip_thinking(slot, new)
                if self.thinking[slot]:
                    continue                 # still thinking: its mask stays ``free``
            m = self.matchers[slot]
            # one by one: llguidance 1.9.1's ``consume_tokens`` refuses a complete grammar's end token
            for t in new:
                if not m.consume_token(t):
                    break
                self.consumed[slot] += 1
            if self._check(slot):
                todo.append((m, slot))     # a complete grammar's mask is its end tokens only
        if todo:
            llnp.fill_next_token_bitmask_par(shared_executor(), todo, self.first)
            for _, slot in todo:
                self._check(slot)

    def _skip_thinking(self, slot: int, new: list[int]) -> list[int]:
        """Count a thinking row's reasoning tokens among ``new`` as consumed → the answer tokens
        after its think end, if it came (its grammar starts there)."""
        if self.think_end not in new:
            self.consumed[slot] += len(new)
            return []
        end = new.index(self.think_end) + 1
        self.consumed[slot] += end
        self.thinking[slot] = False
        return new[end:]

    @named_range("host_masks_along_drafts")
    def path(self, rows: np.ndarray, drafts: np.ndarray) -> np.ndarray:
        """Masks ``[n, K, W]`` for the K verify positions of ``rows`` given their ``drafts [n, K-1]``:
        position j is the mask after the row's tokens and its first j drafts. Past a draft the grammar
        refuses (rejected for sure, so nothing there is ever used) and for unconstrained rows, all-ones."""
        n, k = len(rows), drafts.shape[1] + 1
        out = np.full((n * k, self.words), -1, dtype=np.int32)
        # A row ends at an end token, so nothing after a drafted one is used; and the drafts are cut
        # before it: llguidance 1.9.1 cannot consume the end token after rolling a drafted one back.
        ends = np.isin(drafts, self._eos)
        cut = np.where(ends.any(1), ends.argmax(1), drafts.shape[1])
        jobs, walked = [], []
        for i, s in enumerate(rows.tolist()):   # SYNC: none (host numpy)
            if self.constrained[s]:
                out[i * k] = self.first[s]      # position 0: the mask after the row's tokens, known
                start = self._answer_start(s, drafts[i, : cut[i]])   # None: all of it is reasoning
                if start is None:
                    out[i * k + 1: (i + 1) * k] = self.free
                    continue
                out[i * k + 1: i * k + start] = self.free     # after drafts that are still reasoning
                if start and cut[i] == start:     # the think end was the last draft: only its start state
                    llnp.fill_next_token_bitmask(self.matchers[s], out, i * k + start)
                elif cut[i] > 0 and cut[i] >= start:
                    out[i * k + start + 1: (i + 1) * k] = 0
                    jobs.append((self.matchers[s], i * k + start, drafts[i, start: cut[i]].tolist()))   # SYNC: none (host numpy, read once per cycle)
                    walked.append((i, s))
        if jobs:
            llnp.fill_next_token_bitmask_par_with_draft_tokens(shared_executor(), jobs, out)
            out[~out.any(-1)] = -1      # positions after a refused draft: left empty by llguidance
            for i, s in walked:
                if not self._check(s):
                    out[i * k: (i + 1) * k] = -1    # a failed row's masks: all-ones, its tokens unused
        return out.reshape(n, k, self.words)

    def _answer_start(self, slot: int, drafts: np.ndarray) -> int | None:
        """The verify position where a row's grammar starts (its start state): 0 for a row past its
        thinking; for a thinking row the position after its first drafted think end (the positions
        before it keep the ``free`` mask), None if it drafted none."""
        if not self.thinking[slot]:
            return 0
        hits = np.flatnonzero(drafts == self.think_end)
        return int(hits[0]) + 1 if len(hits) else None


def check_structured(tokenizer, structured) -> Constraint | None:
    """Parse ``structured`` (``{kind: value}`` or a Constraint) and compile it for ``tokenizer`` without
    a model → the normalised :class:`Constraint` (None for None); ``ValueError`` naming the field
    otherwise. For checking a job's constraints before any model loads; one compiler per tokenizer
    (its set-up reads the whole vocabulary), each distinct constraint compiled once."""
    c = parse_constraint(structured)
    if c is not None:
        _checker(tokenizer).matcher(c)
    return c


@functools.lru_cache(maxsize=4)
def _checker(tokenizer) -> GrammarCompiler:
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return GrammarCompiler(tokenizer, len(tokenizer), [eos])
