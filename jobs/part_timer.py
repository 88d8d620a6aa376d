"""Where an engine run's time goes: exclusive seconds of its parts, by wrapping the model's and the
engine's own calls on the instances (a profiling aid for the benches; everything is put back)."""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from orthrus import OrthrusEngine
from orthrus.engine.device import kernels as decode


class PartTimer:
    """Exclusive seconds of the parts of a run, by wrapping the model's and the engine's own calls
    on the instances (and ``decode.constrain``, the device-side masking) until ``restore``."""

    def __init__(self, engine: OrthrusEngine) -> None:
        self.seconds: Counter = Counter()
        self._stack: list[list] = []           # [name, child seconds] of the calls now open
        self._undo: list[Callable[[], None]] = []
        model = engine.model
        forward = model.forward_cached

        def timed_forward(*args, **kwargs):
            if self._stack and self._stack[-1][0] == "prefill":
                return forward(*args, **kwargs)        # the prefill's own forward counts as prefill
            diffusion = kwargs["diffusion"] if "diffusion" in kwargs else args[3]
            return self._time("draft_forward" if diffusion else "verify_forward", forward, args, kwargs)
        self._patch(model, "forward_cached", timed_forward)
        self._wrap(model, "logits", "lm_head")
        grammars = engine.scheduler.grammars
        self._wrap(grammars, "path", "host_masks_along_drafts")
        self._wrap(grammars, "advance", "host_matcher_advance")
        self._wrap(grammars, "admit", "host_matcher_admit")
        for attr, name in (("prefill", "prefill"), ("constrain", "device_masking")):
            fn = getattr(decode, attr)         # module functions the runner calls through ``kernels``
            setattr(decode, attr, lambda *a, _fn=fn, _name=name, **k: self._time(_name, _fn, a, k))
            self._undo.append(lambda _attr=attr, _fn=fn: setattr(decode, _attr, _fn))

    def _patch(self, obj, attr: str, fn: Callable) -> None:
        """``obj.attr = fn`` on the instance until ``restore`` (which puts back what it had, or nothing)."""
        if attr in vars(obj):
            self._undo.append(lambda old=vars(obj)[attr]: setattr(obj, attr, old))
        else:
            self._undo.append(lambda: delattr(obj, attr))
        setattr(obj, attr, fn)

    def _wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            if name == "lm_head" and self._stack and self._stack[-1][0] == "prefill":
                return fn(*args, **kwargs)             # the prefill's own LM head counts as prefill
            return self._time(name, fn, args, kwargs)
        self._patch(obj, attr, timed)

    def _time(self, name: str, fn: Callable, args, kwargs):
        self._stack.append([name, 0.0])
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total = time.perf_counter() - start
            _, child = self._stack.pop()
            self.seconds[name] += total - child
            if self._stack:
                self._stack[-1][1] += total

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


PARTS = ("draft_forward", "verify_forward", "lm_head", "prefill", "host_masks_along_drafts", "host_matcher_advance",
         "host_matcher_admit", "device_masking", "rest")
