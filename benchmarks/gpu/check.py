"""The GPU check: CUDA tests, kernel errors against float64, speed ratios, one training run.

    bash benchmarks/gpu/check.sh                    # all sections, JSON to benchmarks/results/gpu.json
    bash benchmarks/gpu/check.sh --skip train nccl  # leave sections out
    bash benchmarks/gpu/check.sh --out results-dry.json  # write elsewhere (a CPU dry run)

Sections (each says in the table and the JSON why it did not run, where it did not):
  tests   the CUDA tests (tests/attention/test_attn_cuda.py), their pass/skip counts;
  errors  out, dq, dk, dv of every rank's ring schedule in one process (simulate_cp_attention)
          at cp 1/2/4/8, bf16 and fp32, one causal sequence and packed documents, GQA 32/8,
          D=128, against float64; the tolerance of each dtype (CP_TOLERANCES);
  speed   the CP block schedule fwd+bwd (all ranks' blocks, one process) at local lengths
          8k/16k/32k and cp 2, against SDPA flash fwd+bwd on the whole causal sequence: the
          same (query, key) pairs; ratio = cpvlm / SDPA;
  varlen  64 documents in one block: one packed (varlen) call against one call per document;
  train   ``cpvlm train`` at CP=1 on a Qwen3-VL-2B-sized random model, bf16, one 16k-token
          document per step, against the plain HF model's forward+backward+AdamW step on the
          same sample (benchmarks/gpu/train_compare.py): step time and peak memory ratios;
  nccl    on 2+ GPUs: cp_attention on NCCL against float64, and ``cpvlm train --cp 2`` against
          --cp 1 (benchmarks/gpu/nccl_check.py).
Timings are CUDA-event times, best of a few repeats after a warm-up; never test assertions.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE.parent), str(HERE)]
from _common import machine_info, print_table  # noqa: E402
from bench import speed_rows, varlen_rows  # noqa: E402

from cpvlm import ShardPlan  # noqa: E402
from cpvlm.testing.attention_check import CP_TOLERANCES, cp_errors, random_inputs  # noqa: E402

SECTIONS = ("tests", "errors", "speed", "varlen", "train", "nccl")
NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"
DOCS = {"single": [4001], "packed": [1, 15, 700, 37, 1200, 48, 2000]}


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def section_tests(args) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    cmd += ["tests/attention/test_attn_cuda.py"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.tests_timeout)
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1] if lines else proc.stderr.strip()[-500:]
    skips = sorted({line.split(": ", 2)[-1] for line in lines if line.startswith("SKIPPED")})
    if proc.returncode != 0:
        failed = [line for line in lines if line.startswith("FAILED")]
        return {
            "status": "failed",
            "summary": summary,
            "failed": failed,
            "log": proc.stdout[-4000:],
        }
    if " passed" not in summary:
        return {"status": "skipped", "reason": "; ".join(skips), "summary": summary}
    return {"status": "ok", "summary": summary, "skip_reasons": skips}


def section_errors(args) -> dict:
    rows = []
    for cp in args.cps:
        for dtype in (torch.bfloat16, torch.float32):
            for docs_name, docs in DOCS.items():
                plan = ShardPlan(sum(docs), cp, doc_lens=docs)
                tensors = random_inputs(plan, seed=cp, device="cuda", dtype=dtype)
                errors = cp_errors(plan, *tensors, causal=True)
                tol = CP_TOLERANCES[dtype]
                rows.append(
                    {"cp": cp, "dtype": str(dtype).split(".")[1], "docs": docs_name, **errors,
                     "tolerance": tol, "within": max(errors.values()) <= tol}
                )  # fmt: skip
                del tensors
    failed = [r for r in rows if not r["within"]]
    return {"status": "failed" if failed else "ok", "rows": rows}


def section_speed(args) -> dict:
    rows = speed_rows(args.speed_cp, args.local_lens, repeats=args.repeats)
    return {"status": "ok", "goal": "ratio <= 1.15", "rows": rows}


def section_varlen(args) -> dict:
    return {"status": "ok", "rows": varlen_rows(64, 16384, repeats=args.repeats)}


def section_train(args) -> dict:
    cmd = [sys.executable, str(HERE / "train_compare.py"), "--seq-len", str(args.seq_len)]
    cmd += ["--steps", str(args.train_steps)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.train_timeout)
    if proc.returncode != 0:
        return {"status": "failed", "log": (proc.stdout + proc.stderr)[-4000:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["status"] = "ok"
    result["goal"] = "step time ratio <= 1.10"
    return result


def section_nccl(args) -> dict:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        return skipped(
            f"{gpus} GPU: the NCCL checks (cp_attention ring / all-gather on NCCL, cpvlm train "
            "--cp 2 against --cp 1) need 2 or more"
        )
    cmd = [sys.executable, str(HERE / "nccl_check.py")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.train_timeout)
    if proc.returncode != 0:
        return {"status": "failed", "log": (proc.stdout + proc.stderr)[-4000:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"status": "ok" if result.pop("ok") else "failed", **result}


RUN = {
    "tests": section_tests,
    "errors": section_errors,
    "speed": section_speed,
    "varlen": section_varlen,
    "train": section_train,
    "nccl": section_nccl,
}


def environment() -> dict:
    env = {**machine_info(), "cuda": torch.version.cuda, "gpus": torch.cuda.device_count()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
        env["flash_attention"] = torch.backends.cuda.is_flash_attention_available()
    return env


def report(name: str, result: dict) -> None:
    print(
        f"\n== {name}: {result['status']}"
        + (f" ({result['reason']})" if "reason" in result else "")
    )
    if "summary" in result:
        print(result["summary"])
        for reason in result.get("skip_reasons", []):
            print(f"  skipped: {reason}")
    rows = result.get("rows")
    if rows:
        print_table(rows, [c for c in rows[0] if not isinstance(rows[0][c], (list, dict))])
    for key in ("cpvlm", "hf", "ratios", "failed"):
        if key in result:
            print(f"{key}: {json.dumps(result[key])}")
    if result["status"] == "failed" and "log" in result:
        print(result["log"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--skip", nargs="*", default=[], choices=SECTIONS, help="sections to leave out")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--speed-cp", type=int, default=2)
    p.add_argument("--local-lens", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=16384, help="train: tokens per step")
    p.add_argument("--train-steps", type=int, default=4)
    p.add_argument("--tests-timeout", type=float, default=240)
    p.add_argument("--train-timeout", type=float, default=300)
    args = p.parse_args()

    start = time.monotonic()
    results = {"environment": environment()}
    print(json.dumps(results["environment"]))
    cuda = torch.cuda.is_available()
    for name in SECTIONS:
        t0 = time.monotonic()
        if name in args.skip:
            result = skipped("--skip")
        elif not cuda and name != "tests":
            result = skipped(NO_CUDA)
        else:
            try:
                result = RUN[name](args)
            except Exception:
                result = {"status": "failed", "log": traceback.format_exc()[-4000:]}
        result["seconds"] = round(time.monotonic() - t0, 1)
        results[name] = result
        report(name, result)
        if cuda:
            torch.cuda.empty_cache()
    results["seconds"] = round(time.monotonic() - start, 1)

    statuses = [{"section": n, "status": results[n]["status"], "seconds": results[n]["seconds"],
                 "why": results[n].get("reason", "")} for n in SECTIONS]  # fmt: skip
    print()
    print_table(statuses, ["section", "status", "seconds", "why"], title="summary")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out} ({results['seconds']:.0f} s)")
    return 1 if any(s["status"] == "failed" for s in statuses) else 0


if __name__ == "__main__":
    sys.exit(main())
