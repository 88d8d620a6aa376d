"""The KV page pool's host book: free pages, reference counts, each slot's pages, and the page-table
changes the device applies at the start of the next step (``model/cache.py`` holds the pages).

Invariants the scheduler keeps with it (``scheduler.py``):

- before a step's device work, every row that runs owns pages for its committed length plus one
  block (the draft block is written there and the verify pass overwrites it), so a device step
  never allocates and never runs out mid-cycle; a crop stays a length update;
- a page is written only by the one row that owns it alone: pages shared by reference (a prompt
  prefix, ``prefix_cache.py``) lie wholly below every sharer's first written position;
- pages come back when a row finishes, is aborted or is preempted. A page the prefix index still
  names stays *cached* (unreferenced, its K/V intact) until the pool needs it: least recently
  released first.

Host only (numpy, no torch); every loop is bounded by the pages one call hands out or takes back.
"""
from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from orthrus.engine.host.prefix_cache import PageIndex

NULL_PAGE = 0   # the device's null page (``model/cache.py``): never handed out


class PagePool:
    """Pages ``1 … num_pages-1`` of ``page_size`` tokens, lent to ``num_slots`` slots of at most
    ``pages_per_slot`` pages each. A page the prefix ``index`` names is cached, not freed, when its
    last holder lets go, and evicted there when the pool takes it back (None: no prefix cache)."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int, pages_per_slot: int,
                 index: PageIndex | None = None) -> None:
        self.num_pages, self.page_size, self.pages_per_slot = num_pages, page_size, pages_per_slot
        self.index = index
        self.refs = np.zeros(num_pages, dtype=np.int64)
        self.free: deque[int] = deque(range(1, num_pages))
        self.cached: OrderedDict[int, None] = OrderedDict()        # unreferenced, still indexed; oldest first
        self.slot_pages: list[list[int]] = [[] for _ in range(num_slots)]
        # len(slot_pages[s]) for every slot at once: the scheduler's per-step page need is array code
        self.owned = np.zeros(num_slots, dtype=np.int64)
        self._entries: list[tuple[int, int, int]] = []             # (slot, entry, page) since the last take
        self.peak = 0

    @property
    def in_use(self) -> int:
        """Pages some row holds."""
        return self.num_pages - 1 - len(self.free) - len(self.cached)

    def available(self) -> int:
        """Pages a request may take: free, or cached and evictable."""
        return len(self.free) + len(self.cached)

    def pages_for(self, tokens: np.ndarray | int) -> np.ndarray:
        """Pages that hold ``tokens`` positions (capped at a slot's table), element by element."""
        return np.minimum(-(-tokens // self.page_size), self.pages_per_slot)

    def share(self, slot: int, pages: list[int]) -> None:
        """Append ``pages`` (held by other rows, or cached) to ``slot``'s table, by reference."""
        for page in pages:
            self.cached.pop(page, None)
            self.refs[page] += 1
            self._append(slot, page)
        self._note_peak()

    def grow(self, slot: int, total: int) -> list[int]:
        """New pages until ``slot`` holds ``total`` → the pages it took. The caller checked
        :meth:`available` (an empty pool here is a bug, not a condition)."""
        taken = []
        while len(self.slot_pages[slot]) < total:
            page = self._take()
            self.refs[page] = 1
            self._append(slot, page)
            taken.append(page)
        self._note_peak()
        return taken

    def release(self, slot: int) -> None:
        """``slot`` lets go of all its pages (its table entries point at the null page again)."""
        pages = self.slot_pages[slot]
        for entry, page in enumerate(pages):
            self._entries.append((slot, entry, NULL_PAGE))
        for page in reversed(pages):      # a prompt's last page is evicted before its first
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if self.index is not None and page in self.index:
                    self.cached[page] = None
                else:
                    self.free.append(page)
        self.slot_pages[slot] = []
        self.owned[slot] = 0

    def take_entries(self) -> np.ndarray:
        """The page-table changes since the last call, ``[c, 3]`` int64 (slot, entry, page): the last
        change of each entry only (a device scatter with repeated indices keeps an arbitrary one)."""
        last = {(slot, entry): page for slot, entry, page in self._entries}
        self._entries = []
        return np.asarray([(s, e, p) for (s, e), p in last.items()], dtype=np.int64).reshape(-1, 3)

    def reset(self) -> None:
        """Every page free, no slot holding any (the device table is reset with the cache)."""
        self.refs[:] = 0
        self.free = deque(range(1, self.num_pages))
        self.cached.clear()
        self.slot_pages = [[] for _ in self.slot_pages]
        self.owned[:] = 0
        self._entries = []

    def _take(self) -> int:
        if self.free:
            return self.free.popleft()
        page, _ = self.cached.popitem(last=False)     # the least recently released cached page
        self.index.forget(page)                         # only indexed pages are ever cached
        return page

    def _append(self, slot: int, page: int) -> None:
        self._entries.append((slot, len(self.slot_pages[slot]), page))
        self.slot_pages[slot].append(page)
        self.owned[slot] += 1

    def _note_peak(self) -> None:
        self.peak = max(self.peak, self.in_use)
