"""The cost of agreeing before collectives (``cpvlm.distributed.collectives.agree``), per step.

    python benchmarks/agreement.py     # about a minute on 2 cores
    python benchmarks/agreement.py --cp 2 --calls 20 --steps 1 --out-dir DIR  # a trial run

A ContextParallelVLM forward agrees once, at its first collective (the vision rows' route or
gather: the batch fingerprint, the plan, row counts, widths, dtype); the decoder layers'
``cp_attention`` calls skip it (``StepAgreement``). Standalone ``cp_attention`` calls agree every
time. Measured on gloo processes with one thread each:
- agree_us: one ``agree`` call (fingerprint of the facts + one all-reduce of three int64s),
  median of 300 calls after 20 warm-up ones;
- per forward: agreements counted in one forward (the all-reduces of three int64s);
- step_ms: one forward+backward of the memory benchmark's model (4 layers, hidden 256) on a
  packed row of 4096 tokens with 1152 visual tokens, median of 3;
- share: agreements per forward x agree_us over step_ms; "per layer" is what agreeing in every
  decoder layer would cost instead.
Writes agreement.json (in benchmarks/results/ unless --out-dir says otherwise).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import parser, print_table, write_json  # noqa: E402
from memory import VOCAB_DOCS, model_config, packed_batch  # noqa: E402

from cpvlm.distributed.collectives import agree  # noqa: E402
from cpvlm.testing import run_distributed, shutdown_pools  # noqa: E402


def _worker(rank, world_size, calls, steps):
    from transformers import AutoModelForImageTextToText  # here: the workers start faster

    from cpvlm.hf import ContextParallelVLM

    torch.manual_seed(0)
    facts = {
        "plan": (world_size, (4096,)),
        "counts": tuple(range(world_size)),
        "dtype": torch.float32,
    }
    for _ in range(20):
        agree("bench", dist.group.WORLD, facts)
    times = []
    for _ in range(calls):
        dist.barrier()
        t0 = time.perf_counter()
        agree("bench", dist.group.WORLD, facts)
        times.append(time.perf_counter() - t0)

    config = model_config()
    model = AutoModelForImageTextToText.from_config(config).train()
    batch, doc_lens = packed_batch(config, VOCAB_DOCS)
    cp_model = ContextParallelVLM(model, dist.group.WORLD)
    seen = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        if tensor.dtype == torch.int64 and tensor.numel() == 3:
            seen.append(1)
        return real(tensor, *args, **kwargs)

    step_times = []
    for i in range(steps + 1):
        dist.all_reduce = counting if i == 0 else real
        dist.barrier()
        t0 = time.perf_counter()
        cp_model(**batch, doc_lens=doc_lens).loss.backward()
        if i:  # the first step pays one-time set-up
            step_times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    dist.all_reduce = real
    return {
        "agree_s": statistics.median(times),
        "per_forward": len(seen),
        "step_s": statistics.median(step_times),
        "layers": config.text_config.num_hidden_layers,
    }


def main():
    p = parser(__doc__)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    rows = []
    for cp in args.cp:
        ranks = run_distributed(_worker, cp, args.calls, args.steps, timeout=1800)
        shutdown_pools()
        agree_s = max(r["agree_s"] for r in ranks)
        step_s = max(r["step_s"] for r in ranks)
        per_forward, layers = ranks[0]["per_forward"], ranks[0]["layers"]
        rows.append(
            {
                "cp": cp,
                "agree_us": agree_s * 1e6,
                "per_forward": per_forward,
                "step_ms": step_s * 1e3,
                "share_%": 100 * per_forward * agree_s / step_s,
                "per_layer_share_%": 100 * (1 + layers) * agree_s / step_s,
            }
        )
    load = os.getloadavg()
    print_table(
        rows,
        ["cp", "agree_us", "per_forward", "step_ms", "share_%", "per_layer_share_%"],
        title=f"agreement before collectives (gloo, 1 thread per rank; load {load[0]:.1f})",
    )
    write_json(args.out_dir, "agreement", {"rows": rows, "load_average": load, "calls": args.calls})


if __name__ == "__main__":
    main()
