"""How many KV positions the page pool holds: ``OrthrusEngine(kv_cache_tokens=...)``, or a default.

The default on a CPU is what the static layout held, every slot at full length (``slots x
(max_seq_len + block)``): the same memory as before paging, and no row is ever preempted. On a GPU
it is what free device memory holds after the model (less a reserve for activations, sampling and
CUDA graphs), capped at that same figure: more would never be used. Raising ``max_batch_size``
with the pool fixed is how paging turns memory into rows in flight.
"""
from __future__ import annotations

import torch

GPU_MEMORY_FRACTION = 0.90    # of the device memory free when the engine is built
GPU_RESERVE_BYTES = 2 << 30   # left for activations, logits, sampling and captured graphs


def pool_tokens(num_slots: int, capacity: int, page_size: int, bytes_per_token: int, device: torch.device) -> int:
    """The default pool size in tokens (module docstring), in whole pages."""
    row = -(-capacity // page_size) * page_size       # one row at full length, in whole pages
    if device.type != "cuda":
        return num_slots * row
    free, _ = torch.cuda.mem_get_info(device)
    fits = int((free * GPU_MEMORY_FRACTION - GPU_RESERVE_BYTES) // bytes_per_token) // page_size * page_size
    return max(row, min(num_slots * row, fits))


def check_pool(tokens: int, capacity: int, page_size: int) -> None:
    """``ValueError`` unless the pool holds one row at full length (so the oldest row can always run)."""
    need = -(-capacity // page_size) * page_size
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < need:
        raise ValueError(f"kv_cache_tokens must be an int >= {need} (one row at full length: max_seq_len + "
                         f"block_size = {capacity}, in whole pages of {page_size}), got {tokens!r}")
