"""Counter-based per-row random numbers.

Each uniform is a pure hash of ``(row seed, row counter, stream, index)``: a row's draws depend on
nothing but its own seed and progress, so a seeded row samples identically alone or in any batch,
with no per-row generator objects (and no per-row Python) in the decode loop.

All arithmetic stays below 2**63 in int64 (32-bit words times 31-bit odd constants), so it is
exact on every backend.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D
_C2 = 0x5BD1E995
_GOLDEN = 0x9E3779B9

# Streams: which decision a uniform feeds. Distinct streams never share draws.
STREAM_DRAFT = 0
STREAM_ACCEPT = 1
STREAM_RESIDUAL = 2
STREAM_AR = 3
STREAM_FIRST = 4


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mixer on int64 holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def uniforms(seed: torch.Tensor, counter: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """Uniforms in [0, 1) ``[b, n]`` (float64, 53 bits) keyed by ``seed [b]``, ``counter [b]``."""
    idx = torch.arange(n, device=seed.device, dtype=torch.long)[None, :]          # [1, n]
    h = _mix32(idx + (stream << 16))
    h = _mix32(h ^ (counter[:, None] & _M32))
    h = _mix32(h ^ (seed[:, None] & _M32))
    h = _mix32(h ^ ((seed[:, None] >> 32) & _M32))                                  # [b, n]
    h2 = _mix32(h ^ _GOLDEN)
    bits = ((h >> 5) << 26) | (h2 >> 6)                                              # 27 + 26 bits
    return bits.to(torch.float64) * (1.0 / (1 << 53))
