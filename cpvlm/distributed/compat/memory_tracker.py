"""torch's memory tracker (``MemTracker``), with the categories and the global peak cpvlm reads.

Wraps the private ``torch.distributed._tools.mem_tracker`` (``MemTracker``, ``_MemRefType``,
``_RefType`` and the tracker's internals), the profiler's ``record_function`` ops, and DTensor's
sharding propagator: the same names in torch 2.11 to 2.15, nothing to detect.
``TorchDispatchMode`` is here too: benchmarks/memory.py counts live tensor bytes with it.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (benchmarks/memory.py)

# MemTracker's categories, and two that cpvlm attributes by where a storage is made: "Gathered",
# in FSDP2's named all-gather regions (the full-size parameters it gathers, with the all-gather
# buffers), and "Loss", in ``ContextParallelVLM``'s ``cpvlm.loss`` region and in a phase the caller
# opens (the loss's backward: its logit blocks and the head's full-size gradient).
_GATHER_REGIONS = ("FSDP::all_gather",)  # also matches "FSDP::all_gather_copy_out"
_LOSS_REGIONS = ("cpvlm.loss",)
GATHERED, LOSS = "Gathered", "Loss"


def memory_tracker():
    """torch's ``MemTracker`` (bytes by PARAM, BUFFER, GRAD, ACT, TEMP, OPT; peaks per device) with
    two more categories, ``GATHERED`` and ``LOSS`` (above), keeping only the global peak: its
    per-module peaks cost a pass over every module on every op (minutes for a real model), and
    cpvlm reads the global ones.

    ``tracker.push(category)`` / ``tracker.pop(category)`` label what is allocated between them;
    ``tracker.category_of(t)`` is the category of ``t``'s storage (None if untracked)."""
    from torch.distributed._tools import mem_tracker

    names = {m.name: m.value for m in mem_tracker._MemRefType}
    RefType = mem_tracker._RefType("CpvlmRefType", {**names, "GATHERED": GATHERED, "LOSS": LOSS})
    sticky = {RefType.GATHERED, RefType.LOSS}
    regions = [(r, RefType.GATHERED) for r in _GATHER_REGIONS]
    regions += [(r, RefType.LOSS) for r in _LOSS_REGIONS]
    enter_region = torch.ops.profiler._record_function_enter_new.default
    exit_region = torch.ops.profiler._record_function_exit._RecordFunction

    class GlobalPeakTracker(mem_tracker.MemTracker):
        def __init__(self):
            super().__init__()
            self._ref_class = RefType
            # Open labels, innermost last: (True, category or None) for a record_function region
            # (regions nest: each exit closes the innermost), (False, category) for a push.
            self._labels: list = []

        def push(self, category: str) -> None:
            self._labels.append((False, RefType(category)))

        def pop(self, category: str) -> None:
            """Close the innermost push of ``category`` (if open)."""
            for i in range(len(self._labels) - 1, -1, -1):
                if self._labels[i] == (False, category):
                    del self._labels[i]
                    return

        def _label(self):
            return next((c for _, c in reversed(self._labels) if c is not None), None)

        def category_of(self, t: torch.Tensor) -> str | None:
            winfo, _ = self._WINFO.get(t.untyped_storage(), (None, None))
            return None if winfo is None else str(winfo.reftype.value)

        # DTensor's sharding propagation runs each op once more on global-shape fake tensors, in
        # the enclosing fake mode (``detect_fake_mode()``), which MemTracker takes for the real
        # op: a sharded optimizer step counted at the unsharded size (issue 30: 27x its state).
        # Those ops are not tracked; the local ops DTensor then runs are.
        def __enter__(self):
            from torch.distributed.tensor import DTensor

            self._propagator = DTensor._op_dispatcher.sharding_propagator
            inner, self._propagating = self._propagator._propagate_tensor_meta_non_cached, False

            def untracked(*args, **kwargs):
                self._propagating = True
                try:
                    return inner(*args, **kwargs)
                finally:
                    self._propagating = False

            self._propagator._propagate_tensor_meta_non_cached = untracked
            return super().__enter__()

        def __exit__(self, *exc):
            try:
                return super().__exit__(*exc)
            finally:
                del self._propagator._propagate_tensor_meta_non_cached

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self._propagating:
                return func(*args, **(kwargs or {}))
            if func is enter_region:
                name = str(args[0])
                category = next((c for r, c in regions if name.startswith(r)), None)
                self._labels.append((True, category))
            elif func is exit_region:
                i = next(i for i in range(len(self._labels) - 1, -1, -1) if self._labels[i][0])
                del self._labels[i]
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _track(self, reftype, t: torch.Tensor) -> None:
            label = None if self._in_opt else self._label()
            super()._track(reftype if label is None else label, t)

        def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
            # MemTracker relabels a module's parameters PARAM and a parameter's gradient GRAD
            # when it meets them; a gathered full-size parameter (FSDP2 registers it on the
            # module) and the loss's full-size head gradient keep the category they were made in.
            for st in mem_tracker.get_untyped_storages(t):
                winfo, _ = self._WINFO.get(st, (None, None))
                if winfo is not None and winfo.reftype in sticky:
                    reftype = winfo.reftype
            return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

        def reset_peak(self) -> None:
            """Start the global peak again from the bytes live now."""
            self._peak_mem.clear()
            self._peak_mem_snap.clear()
            for dev, snap in self._curr_mem_snap.items():
                self._peak_mem[dev] = snap[mem_tracker._TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[mem_tracker._TOTAL_KEY]:
                    self._peak_mem[dev] = snap[mem_tracker._TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

    return GlobalPeakTracker()
