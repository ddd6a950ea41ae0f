"""The simulated step against the real one: bytes of a CPU run on gloo, measured by the live-tensor
tracker of ``benchmarks/memory.py`` (``StepMemory``), beside ``cpvlm.simulate``'s figures.

The real run is the simulated one without fakes: the same model config, batch (``build_batch``,
real pixels), ``ContextParallelVLM`` options, float32, no FSDP, no optimizer. Compared:
- ``saved``: bytes saved for backward at the end of the forward, on every rank (both count each
  storage once, parameters excluded): equal;
- ``peak``: the peak of live bytes of forward + backward beyond the parameters (StepMemory's
  ``peak_total``: activations, temporaries and gradients) against MemTracker's peak minus its
  parameters and buffers. (Neither counts the batch, made before the step: the tower's input
  MemTracker sees is the pixels' cast copy, which the real run, holding float32 pixels, makes
  no copy of; the simulated batch's pixels are bfloat16: this copy, ~1 MiB here, is counted.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cpvlm.options import CPOptions

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def real_step(rank: int, world_size: int, config, spec, attn: str, loss_chunk) -> dict:
    """``run_distributed`` worker: one real forward + backward of CP rank ``rank``."""
    sys.path.insert(0, str(BENCHMARKS))
    from memory import StepMemory  # benchmarks/memory.py

    from cpvlm.hf import ContextParallelVLM
    from cpvlm.simulate.batch import build_batch

    torch.manual_seed(0)
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(config).train()
    batch, doc_lens = build_batch(config, spec)
    batch = {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}
    cp_model = ContextParallelVLM(
        model, dist.group.WORLD, options=CPOptions(attn=attn), loss_chunk=loss_chunk
    )
    tracker = StepMemory(model, set())
    with tracker, torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
        out = cp_model(**batch, doc_lens=doc_lens)
        saved = sum(tracker.saved_by_where().values())
        out.loss.backward()
    return {"saved": saved, "peak": tracker.peak_total}


def simulated_step(config, spec, cp: int, rank: int, attn: str, loss_chunk) -> dict:
    from cpvlm.simulate.rank import Setup, simulate_step

    setup = Setup(
        cp=cp,
        rank=rank,
        attn=attn,
        loss_chunk=loss_chunk,
        data_parallel="none",
        compute_dtype=None,
        optimizer=False,
        reduced_depth=False,
    )
    m = simulate_step(config, spec, setup)
    at_peak = m.peak_by_category
    return {
        "saved": m.saved,
        "peak": m.peak_fwd_bwd - at_peak.get("Parameter", 0) - at_peak.get("Buffer", 0),
    }
