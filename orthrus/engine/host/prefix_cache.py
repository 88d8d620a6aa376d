"""Prefix cache (host side): which KV pages hold which prompt prefixes, and which running slots
hold which prompts.

Two lookups, both keyed like vLLM's: a prompt is cut into pages of ``block`` tokens (the cache's
page size), each hashed together with the hash of everything before it (a chained hash names a
whole prefix), so the longest run of shared whole pages is found with one dict probe per page.

- :class:`PageIndex` names *full prompt pages* by their chained hash. A request whose prompt starts
  with those pages takes them by reference (``pages.py``) and computes only the rest; a page stays
  findable after its rows finish, until the pool needs it (then it is evicted, least recently
  released first). Every hit is checked token by token against the page's own tokens: a hash
  collision can only shorten a match, never share a wrong page.
- :class:`PrefixIndex` names the *slots* running a prompt. It extends a match token by token past
  the last whole page: the holder's partial page is copied into a page of the new row (its prompt
  tail, or all of it for an identical prompt: the n samples of one row), and an identical prompt
  also reuses the holder's last hidden state and computes nothing.

Shared pages lie wholly below every sharer's first written position (a row writes at its committed
length, at least its prompt length), so no forward writes a page another row holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PREFIX_BLOCK = 16   # tokens per hashed block (the SDPA cache's page size): the shortest shared prefix


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


class PageIndex:
    """Full prompt pages by chained hash (one page per hash), each with its own tokens."""

    def __init__(self, block: int = PREFIX_BLOCK) -> None:
        self.block = block
        self._by_hash: dict[int, int] = {}                       # chained hash -> page
        self._of_page: dict[int, tuple[int, bytes]] = {}         # page -> (its hash, its tokens)

    def __contains__(self, page: int) -> bool:
        return page in self._of_page

    def __len__(self) -> int:
        return len(self._of_page)

    def match(self, prompt: np.ndarray, hashes: list[int], limit: int) -> list[int]:
        """The pages of the longest run of ``prompt``'s leading whole pages held here (at most ``limit``)."""
        pages = []
        for j, h in enumerate(hashes[:limit]):   # chained: a miss at page j means no longer match exists
            page = self._by_hash.get(h)
            if page is None or self._of_page[page][1] != prompt[j * self.block: (j + 1) * self.block].tobytes():
                break
            pages.append(page)
        return pages

    def add(self, prompt: np.ndarray, hashes: list[int], pages: list[int]) -> None:
        """``pages[j]`` holds ``prompt``'s whole page j (for every j < len(pages)); a hash already
        named keeps its page."""
        for j, (h, page) in enumerate(zip(hashes, pages)):
            if h not in self._by_hash and page not in self._of_page:
                self._by_hash[h] = page
                self._of_page[page] = (h, prompt[j * self.block: (j + 1) * self.block].tobytes())

    def forget(self, page: int) -> None:
        """``page`` is about to be reused (evicted). Unknown pages: no-op."""
        entry = self._of_page.pop(page, None)
        if entry is not None:
            del self._by_hash[entry[0]]

    def clear(self) -> None:
        """Forget every page."""
        self._by_hash.clear()
        self._of_page.clear()


class PrefixIndex:
    """Slots running a prompt (its pages held), findable by prompt prefix."""

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
        """``slot`` now runs ``prompt`` (replacing whatever it ran)."""
        self.remove(slot)
        hashes = block_hashes(prompt, self.block) if hashes is None else hashes
        self._prompts[slot], self._hashes[slot] = prompt, hashes
        for h in hashes:
            self._by_hash.setdefault(h, {})[slot] = None
        self._by_prompt.setdefault(prompt.tobytes(), {})[slot] = None

    def remove(self, slot: int) -> None:
        """Forget ``slot`` (it finished or lost its pages). Unknown: no-op."""
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
