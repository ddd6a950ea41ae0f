"""The NCCL part of the GPU check (2+ GPUs): cp_attention and vision gathering on NCCL, and
``cpvlm train --cp 2`` against ``--cp 1``.

    python benchmarks/gpu/nccl_check.py          # launches itself under torchrun on 2 GPUs

  attention  ring and all-gather cp_attention at CP=2, bf16 and fp32, packed documents, GQA 32/8,
             D=128, forward and backward through autograd, against float64 (CP_TOLERANCES);
  vision     gather_embeddings with 3 rows on rank 0 and none on rank 1: every rank gets
             all rows; rank r's gradient is the sum over ranks of the upstream gradient;
  train      the tiny Qwen3-VL, float32, 3 steps: per-step losses of --cp 2 against --cp 1
             (relative difference <= 1e-5, float32 as everywhere in cpvlm).
Prints one JSON line last, with "ok".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
DOCS = [1, 15, 700, 37, 1200, 48]


def _attention(rank: int, world: int, device: torch.device) -> list[dict]:
    from cpvlm import ShardPlan
    from cpvlm.attention import cp_attention
    from cpvlm.testing.attention_check import (
        CP_TOLERANCES,
        random_inputs,
        reference_attention,
        unshard,
    )
    from cpvlm.verify.compare import rel_err

    plan = ShardPlan(sum(DOCS), world, doc_lens=DOCS)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v, dout = random_inputs(plan, seed=5, device=device, dtype=dtype)
        expected = reference_attention(plan, q, k, v, dout, causal=True)
        for impl in ("ring", "allgather"):
            leaves = [plan.shard(t, rank, seq_dim=2).detach().requires_grad_() for t in (q, k, v)]
            out = cp_attention(*leaves, plan=plan, group=dist.group.WORLD, impl=impl)
            out.backward(plan.shard(dout, rank, seq_dim=2))
            errors = {}
            for j, (name, t) in enumerate(zip(("out", "dq", "dk", "dv"), (out, *[x.grad for x in leaves]))):  # fmt: skip
                shards = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(shards, t.detach().contiguous())
                errors[name] = rel_err(unshard(plan, shards), expected[j])
            tol = CP_TOLERANCES[dtype]
            rows.append({"impl": impl, "dtype": str(dtype).split(".")[1], **errors,
                         "tolerance": tol, "within": max(errors.values()) <= tol})  # fmt: skip
    return rows


def _vision(rank: int, world: int, device: torch.device) -> dict:
    from cpvlm.encoders import gather_embeddings

    counts = [3] + [0] * (world - 1)
    x = torch.arange(counts[rank] * 4, dtype=torch.float32, device=device).view(-1, 4)
    x.requires_grad_()
    out = gather_embeddings(x, counts, dist.group.WORLD)
    weight = torch.arange(12, dtype=torch.float32, device=device).view(3, 4)
    (out * weight).sum().backward()
    values_ok = torch.equal(out.detach(), torch.arange(12.0, device=device).view(3, 4))
    grad_ok = torch.equal(x.grad, (world * weight)[: counts[rank]])
    return {"values": bool(values_ok), "gradients": bool(grad_ok)}


def worker(result_path: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    attention = _attention(rank, world, device)
    vision = _vision(rank, world, device)
    flags = torch.tensor(
        [all(r["within"] for r in attention) and all(vision.values())], device=device
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if rank == 0:
        Path(result_path).write_text(json.dumps({"attention": attention, "vision": vision,
                                                 "ok": bool(flags.item())}))  # fmt: skip
    dist.destroy_process_group()


def _torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]  # fmt: skip


def _train_losses(cp: int, out: Path) -> list[float]:
    flags = ["--cp", str(cp), "--model", "qwen3-vl-tiny", "--dtype", "float32", "--steps", "3"]
    flags += ["--seq-len", "512", "--device", "cuda", "--out", str(out)]
    subprocess.run(
        _torchrun(cp, "-m", "cpvlm.train", *flags), cwd=ROOT, check=True, stdout=sys.stderr
    )
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", metavar="RESULT_JSON")
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
        return
    with tempfile.TemporaryDirectory(prefix="cpvlm-nccl-") as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = _torchrun(2, str(Path(__file__).resolve()), "--worker", str(result_path))
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=sys.stderr)
        result = json.loads(result_path.read_text())
        cp1, cp2 = _train_losses(1, Path(tmp) / "cp1"), _train_losses(2, Path(tmp) / "cp2")
    diffs = [abs(a - b) / abs(a) for a, b in zip(cp1, cp2)]
    result["train"] = {"losses_cp1": cp1, "losses_cp2": cp2, "max_rel_diff": max(diffs)}
    result["ok"] = result["ok"] and max(diffs) <= 1e-5
    print(json.dumps(result))


if __name__ == "__main__":
    main()
