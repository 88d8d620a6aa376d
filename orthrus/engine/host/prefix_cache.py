"""Prefix cache (host side): which slots hold the K/V of which prompt prefixes.

A slot's cache positions below its prompt length hold that prompt's K/V from its prefill until
something overwrites them: never while its request runs (a block is written at the row's committed
length, which is at least the prompt length), and not after it finishes either unless a later
iteration writes there (a static-shape iteration pads with free slots, and a row that died at its
prefill runs one dead iteration writing at position 0; the engine drops such slots from here). So
the slots themselves are the cache: a new request whose prompt starts like a prompt some slot holds
copies those positions' K/V on the device (a copy of ``m`` positions instead of a forward over
them) and prefills only the rest.

Lookup, as vLLM does: a prompt is cut into fixed blocks of ``block`` tokens, each hashed together
with the hash of everything before it (a chained hash names a whole prefix), so the longest shared
run of whole blocks is found with one dict probe per block. The match is then checked and extended
token by token against the holder's prompt (a hash collision can only shorten it, never make a
wrong copy), up to the whole prompt: an identical prompt also reuses the holder's last hidden state
and computes nothing (the n samples of one row). Memory: a few integers per block of each held
prompt, bounded by the slot count.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PREFIX_BLOCK = 16   # tokens per hashed block: the shortest shared prefix worth a lookup


def block_hashes(prompt: np.ndarray, block: int) -> list[int]:
    """Chained hashes of the prompt's whole blocks: entry j names tokens ``0 … (j+1)*block - 1``."""
    out, prev = [], 0
    for j in range(len(prompt) // block):
        prev = hash((prev, prompt[j * block: (j + 1) * block].tobytes()))
        out.append(prev)
    return out


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common leading run of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass(frozen=True)
class Match:
    """A holder of a request's prompt prefix: copy ``length`` positions from ``slot``; ``whole``:
    the holder's prompt is this very prompt (its last hidden state is reusable too)."""

    slot: int
    length: int
    whole: bool


class PrefixIndex:
    """Slots whose prompt K/V is intact, findable by prompt prefix."""

    def __init__(self, block: int = PREFIX_BLOCK) -> None:
        self.block = block
        self._prompts: dict[int, np.ndarray] = {}            # slot -> its prompt
        self._hashes: dict[int, list[int]] = {}              # slot -> its block hashes
        self._by_hash: dict[int, dict[int, None]] = {}       # block hash -> slots (ordered set)
        self._by_prompt: dict[bytes, dict[int, None]] = {}   # whole prompt -> slots

    def __contains__(self, slot: int) -> bool:
        return slot in self._prompts

    def __len__(self) -> int:
        return len(self._prompts)

    def add(self, slot: int, prompt: np.ndarray, hashes: list[int] | None = None) -> None:
        """``slot`` now holds ``prompt``'s K/V (replacing whatever it held)."""
        self.remove(slot)
        hashes = block_hashes(prompt, self.block) if hashes is None else hashes
        self._prompts[slot], self._hashes[slot] = prompt, hashes
        for h in hashes:
            self._by_hash.setdefault(h, {})[slot] = None
        self._by_prompt.setdefault(prompt.tobytes(), {})[slot] = None

    def remove(self, slot: int) -> None:
        """Forget ``slot`` (its K/V is about to be, or may have been, overwritten). Unknown: no-op."""
        prompt = self._prompts.pop(slot, None)
        if prompt is None:
            return
        for h in self._hashes.pop(slot):
            _discard(self._by_hash, h, slot)
        _discard(self._by_prompt, prompt.tobytes(), slot)

    def clear(self) -> None:
        """Forget every slot."""
        for table in (self._prompts, self._hashes, self._by_hash, self._by_prompt):
            table.clear()

    def match(self, prompt: np.ndarray, hashes: list[int]) -> Match | None:
        """The longest held prefix of ``prompt`` (at least one whole block, or the whole prompt), or None."""
        same = self._by_prompt.get(prompt.tobytes())
        if same:
            return Match(next(iter(same)), len(prompt), True)
        found = None
        for h in hashes:                      # chained: a miss at block j means no longer match exists
            slots = self._by_hash.get(h)
            if not slots:
                break
            found = slots
        if found is None:
            return None
        slot = next(iter(found))
        # Checked token by token (a collision only shortens the match) and extended past the last
        # whole block; the last prompt token is always computed (its hidden state gives the first token).
        length = min(common_prefix(prompt, self._prompts[slot]), len(prompt) - 1)
        return Match(slot, length, False) if length >= self.block else None


def _discard(table: dict, key, slot: int) -> None:
    slots = table.get(key)
    if slots is not None:
        slots.pop(slot, None)
        if not slots:
            del table[key]
