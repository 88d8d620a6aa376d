"""The compiled layer: each decoder layer's work outside attention through ``torch.compile`` (inductor).

Why these pieces: a decoder layer is the two views' projections, RMSNorms, rotary, the SwiGLU MLP
and the residual adds around one attention call; eagerly every elementwise op is a kernel launch
(about 455 aten ops per AR step of the bundled 4-layer model, ``python -m jobs.bench compiled``).
Inductor fuses the elementwise chains around the matmuls. Attention itself (the paged cache's
scatter, the page gather, SDPA or flash) stays eager: it mutates the cache, and compiled it would be
functionalised into copies of the page pool.

Why not one graph per static plan: measured on the 2-core CPU (performance.md, "Compiled step"),
a whole iteration compiled per ``IterationPlan`` took 92 s (an AR step) and 392 s (a cycle) cold,
one graph per (block size, row bucket, key bound, verify budget, sampling flags): the demo job meets
dozens of plans. The pieces here are shape-generic: they see a forward's tokens as one flat sequence
whose length is symbolic (``dynamic=True``, never specialised to 1: :func:`using`), so one set
serves every plan, prefill and both views, and every layer (inline nn-module tracing makes the
parameters inputs). The graphs are known up front: {before attention, after attention} × {AR view,
diffusion view}, four per dtype; tens of seconds cold, seconds from the disk cache. On CUDA the static
path's graph capture records these compiled kernels like any others.

Inductor's caches (FX graphs, AOT autograd, kernels) live on local disk under
``TORCHINDUCTOR_CACHE_DIR``, which :func:`use_local_cache` points at ``~/.cache/orthrus/inductor``
unless it is set: a second process on the node (a restarted actor, a resumed job) loads its graphs.
Torch's compiler is imported only by :func:`layer_fns`: an engine without compile never loads it
(``tests/unit/test_startup_imports.py``).
"""
from __future__ import annotations

import os
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from orthrus.model.attention import merge_heads

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


@dataclass(frozen=True)
class LayerFns:
    """A decoder layer's two compiled pieces per view: ``before[diffusion](layer, h, cos, sin)`` → q,
    k, v; ``after[diffusion](layer, h, attn)`` → the layer's output (``qwen3.OrthrusDecoderLayer``)."""

    before: tuple[Callable, Callable]
    after: tuple[Callable, Callable]


_ACTIVE: ContextVar[LayerFns | None] = ContextVar("orthrus_layer_fns", default=None)


def active() -> LayerFns | None:
    """The compiled pieces the current device work runs (None: eager). Under an outer trace (the
    static-graph tests compile a whole iteration) None: the plain layer is traced into that graph,
    and dynamo cannot read a ContextVar."""
    if torch.compiler.is_compiling():
        return None
    return _ACTIVE.get()


@contextmanager
def using(fns: LayerFns) -> Iterator[None]:
    """Run the layers inside with ``fns`` (a model shared by a compiled engine and an eager one,
    e.g. the job's audit engine, runs each engine's way). Shapes seen while compiling are never
    specialised to 1 (one row, one token: the same graph as many) nor unified with an equal size
    (duck shapes: a block of 8 tokens and a head dim of 8), so the set of graphs stays the one above;
    a module's float (an RMSNorm's epsilon) is a constant, not an input wrapped in a tensor per call
    (a host-to-device copy on every call: ``testing/host_syncs.py`` counts them)."""
    from torch._dynamo import config as dynamo
    from torch.fx.experimental import _config as shapes

    token = _ACTIVE.set(fns)
    try:
        with shapes.patch(use_duck_shape=False, backed_size_oblivious=True), dynamo.patch(specialize_float=True):
            yield
    finally:
        _ACTIVE.reset(token)


def layer_forward(fns: LayerFns, layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend,
                  diffusion: bool) -> torch.Tensor:
    """``qwen3.OrthrusDecoderLayer.forward`` through the compiled pieces: they see the ``b x T``
    tokens as one flat ``[1, N, E]`` sequence (one symbolic size for every plan; a ragged forward is
    already flat), attention sees its rows ``[b, H, T, D]`` as always."""
    b, t, e = h.shape
    flat = h.reshape(1, b * t, e)
    q, k, v = fns.before[diffusion](layer, flat, cos.reshape(1, b * t, -1), sin.reshape(1, b * t, -1))
    q, k, v = (x[0].view(x.shape[1], b, t, x.shape[3]).transpose(0, 1) for x in (q, k, v))   # [b, H, T, D]
    attn = layer.self_attn
    out = attend(attn.layer_idx, q, k, v, attn.scale)                                         # [b, H, T, D]
    # [1, N, H*D], contiguous whatever layout the kernel returned: the piece is traced for one layout
    merged = merge_heads(out).reshape(1, b * t, -1)
    return fns.after[diffusion](layer, flat, merged).view(b, t, e)


def default_cache_dir() -> Path:
    """Where compiled graphs are cached when ``TORCHINDUCTOR_CACHE_DIR`` is not set: node-local."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "orthrus" / "inductor"


def use_local_cache() -> str:
    """Point inductor's on-disk caches at :func:`default_cache_dir` unless the environment chose one
    (before the first compile: inductor reads the variable when it first writes) → the directory."""
    if not os.environ.get(CACHE_ENV):
        os.environ[CACHE_ENV] = str(default_cache_dir())
    return os.environ[CACHE_ENV]


@lru_cache(maxsize=None)
def layer_fns(dtype: torch.dtype) -> LayerFns:
    """The compiled pieces for weights of ``dtype`` (one set per process and dtype, shared by every
    engine: dynamo keeps graphs per code object, and each piece here has its own)."""
    use_local_cache()

    def compiled(fn: Callable) -> Callable:
        return torch.compile(_own_code(fn), fullgraph=True, dynamic=True)
    return LayerFns(before=(compiled(_before_ar), compiled(_before_diffusion)),
                    after=(compiled(_after_ar), compiled(_after_diffusion)))


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (a step that adds some spent its time compiling)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _before_ar(layer, h, cos, sin):
    return layer.attention_inputs(h, cos, sin, False)


def _before_diffusion(layer, h, cos, sin):
    return layer.attention_inputs(h, cos, sin, True)


def _after_ar(layer, h, merged):
    return layer.finish(h, merged, False)


def _after_diffusion(layer, h, merged):
    return layer.finish(h, merged, True)


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own, so each dtype's set keeps its graphs apart: dynamo keys
    its cache (and its recompile limit, 8) by code object and checks the guards of every graph on it
    in turn at each call."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    return own
