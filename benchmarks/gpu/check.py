"""The GPU check: CUDA tests, kernel errors against float64, speed ratios, one training run.

    bash benchmarks/gpu/check.sh --out DIR/gpu.json          # all sections, under 500 s
    bash benchmarks/gpu/check.sh --out DIR/gpu.json --deadline 300 --skip train

Sections, fast ones first; each says in the table and the JSON why it did not run, where it did
not, and the JSON is rewritten after every section, so a run cut short keeps what it measured:
  tests   the CUDA tests (tests/attention/test_attn_cuda.py), their pass/skip counts;
  errors  out, dq, dk, dv of every rank's ring schedule in one process (simulate_cp_attention)
          at cp 1/2/4/8, bf16 and fp32, one causal sequence and packed documents, GQA 32/8,
          D=128, against float64; the tolerance of each dtype (CP_TOLERANCES);
  speed   the CP block schedule fwd+bwd (all ranks' blocks, one process) at local lengths
          8k/16k/32k and cp 2, against SDPA flash fwd+bwd on the whole causal sequence: the
          same (query, key) pairs; ratio = cpvlm / SDPA;
  varlen  64 documents in one block: one packed (varlen) call against one call per document;
  nccl    on 2+ GPUs: cp_attention on NCCL against float64, and ``cpvlm train --cp 2`` against
          --cp 1 (benchmarks/gpu/nccl_check.py);
  train   ``cpvlm train`` at CP=1 on a Qwen3-VL-2B-wide random model (fewer layers, so that the
          saved model and the run's final checkpoint stay small), bf16, one 16k-token document
          per step, against the plain HF model's forward+backward+AdamW step on the same sample
          (benchmarks/gpu/train_compare.py): step time and peak memory ratios.
One deadline (--deadline, seconds from the start) covers everything: each section's budget is its
share of the time left, printed before it runs; a subprocess section is killed at its budget, an
in-process one stops between rows. Timings are CUDA-event times, best of a few repeats after a
warm-up; never test assertions. Exit status 1 when a section failed, 0 otherwise (skips too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

SECTIONS = ("tests", "errors", "speed", "varlen", "nccl", "train")
SHARES = {"tests": 3, "errors": 2, "speed": 2, "varlen": 1, "nccl": 2, "train": 6}
"""A section's budget is its share over the shares of the sections still to run, of the time
left (so what a fast section leaves goes to the later ones)."""
RESERVE_S = 10.0
"""Kept back from the deadline for the summary and the last write of the JSON."""
DOCS = {"single": [4001], "packed": [1, 15, 700, 37, 1200, 48, 2000]}


LIBRARIES = ("transformers", "trl", "peft", "accelerate", "tokenizers", "huggingface_hub")
"""Whose versions the JSON's environment names (read from the metadata: nothing is imported)."""
_CARRIED = (
    "accelerate annotated-doc annotated-types anyio click datasets dill filelock fsspec h11 hf-xet "
    "httpcore2 httpx2 huggingface-hub idna jinja2 kernels markdown-it-py markupsafe mdurl "
    "multiprocess packaging peft psutil pydantic pydantic-core pygments pyyaml regex rich "
    "safetensors shellingham tokenizers tomlkit tqdm transformers trl truststore typer "
    "typing-extensions typing-inspection xxhash"
)
CHECK_WHEELS = tuple(_CARRIED.split())
"""What ``--wheels`` carries to a GPU machine: transformers, trl, peft, accelerate and everything
they need (at the versions of constraints.txt) but torch and the large compiled libraries the
machine has with its torch (numpy, pandas, pyarrow; tests/gpu checks this list against the
dependencies). ``--requirements`` prints their lines of constraints.txt for ``pip download``."""


class SectionTimeout(Exception):
    """A section ran past its budget."""


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


# ---- what can run here -------------------------------------------------------------------------


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def requirements() -> list[str]:
    """The lines of constraints.txt that pin CHECK_WHEELS (SystemExit naming any unpinned)."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, sep, _ = line.partition("==")
        if sep and not line.startswith("#"):
            pins[_normalized(name.strip())] = line.strip()
    missing = [n for n in CHECK_WHEELS if _normalized(n) not in pins]
    if missing:
        raise SystemExit(f"check.py: constraints.txt pins none of {', '.join(missing)}")
    return [pins[_normalized(n)] for n in CHECK_WHEELS]


def versions(names) -> dict:
    """{name: installed version, or None}, from the metadata of the running interpreter."""
    from importlib import metadata

    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def carried_wheels() -> dict | None:
    """What check.sh --wheels did (None without it): the folder, its number of wheels, whether
    they went in, and the distributions found here at another version than their wheel's."""
    folder = os.environ.get("CPVLM_CHECK_WHEELS")
    if not folder:
        return None
    wheels = sorted(Path(folder).glob("*.whl"))
    carried = {w.name.split("-")[0]: w.name.split("-")[1] for w in wheels}
    found = versions(carried)
    info = {"dir": folder, "wheels": len(wheels)}
    info["installed"] = "CPVLM_CHECK_WHEELS_ERROR" not in os.environ
    # Each wheel's distribution whose version found here is not the carried one (a wheel not
    # installed, or shadowed): empty where all went well.
    info["other_version"] = {n: found[n] for n, v in sorted(carried.items()) if found[n] != v}
    if not info["installed"]:
        info["error"] = os.environ["CPVLM_CHECK_WHEELS_ERROR"]
    if "CPVLM_CHECK_WHEELS_NO_DEPS" in os.environ:
        info["no_deps"] = os.environ["CPVLM_CHECK_WHEELS_NO_DEPS"]
    return info


def probe() -> tuple[dict, str | None]:
    """(the environment, why no section can run here or None)."""
    env = {"python": sys.version.split()[0], "executable": sys.executable, "cpus": os.cpu_count()}
    env["libraries"] = versions(LIBRARIES)
    wheels = carried_wheels()
    if wheels is not None:
        env["wheels"] = wheels
    try:
        import torch
    except Exception as e:  # noqa: BLE001 (the check reports every failure, it never dies)
        return env, f"torch cannot be imported ({type(e).__name__}: {e})"
    env.update(torch=torch.__version__, cuda=torch.version.cuda)
    if not torch.cuda.is_available():
        return env, "no CUDA device (torch.cuda.is_available() is False)"
    env.update(gpus=torch.cuda.device_count(), gpu=torch.cuda.get_device_name())
    env["capability"] = list(torch.cuda.get_device_capability())
    env["flash_attention"] = torch.backends.cuda.is_flash_attention_available()
    return env, None


# ---- sections ----------------------------------------------------------------------------------


def _run(cmd: list[str], budget: float) -> tuple[int | None, str, str]:
    """(exit status or None on timeout, stdout, stderr) of ``cmd`` killed with its children at
    ``budget`` seconds (train_compare.py starts ``cpvlm train``; nothing may outlive the check)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=max(budget, 1.0))
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def section_tests(args, budget: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    cmd += ["tests/attention/test_attn_cuda.py"]
    code, stdout, stderr = _run(cmd, budget)
    lines = stdout.strip().splitlines()
    summary = lines[-1] if lines else stderr.strip()[-500:]
    skips = sorted({line.split(": ", 2)[-1] for line in lines if line.startswith("SKIPPED")})
    if code is None:
        return {"status": "timeout", "reason": f"past its budget of {budget:.0f} s",
                "log": stdout[-4000:]}  # fmt: skip
    if code != 0:
        failed = [line for line in lines if line.startswith("FAILED")]
        return {"status": "failed", "summary": summary, "failed": failed, "log": stdout[-4000:]}
    if " passed" not in summary:
        return {"status": "skipped", "reason": "; ".join(skips), "summary": summary}
    return {"status": "ok", "summary": summary, "skip_reasons": skips}


def _rows(make_rows, budget_end: float) -> tuple[list[dict], bool]:
    """Rows from the callables in ``make_rows`` until the budget ends: (rows, all of them)."""
    rows = []
    for make in make_rows:
        if time.monotonic() >= budget_end:
            return rows, False
        rows.append(make())
    return rows, True


def _partial(result: dict, complete: bool, rows: list[dict]) -> dict:
    if not complete:
        result["partial"] = f"budget reached after {len(rows)} rows"
    return result


def section_errors(args, budget: float) -> dict:
    import torch

    from cpvlm import ShardPlan
    from cpvlm.testing.attention_check import CP_TOLERANCES, cp_errors, random_inputs

    def row(cp, dtype, docs_name):
        docs = DOCS[docs_name]
        plan = ShardPlan(sum(docs), cp, doc_lens=docs)
        tensors = random_inputs(plan, seed=cp, device="cuda", dtype=dtype)
        errors = cp_errors(plan, *tensors, causal=True)
        tol = CP_TOLERANCES[dtype]
        return {"cp": cp, "dtype": str(dtype).split(".")[1], "docs": docs_name, **errors,
                "tolerance": tol, "within": max(errors.values()) <= tol}  # fmt: skip

    makers = [
        lambda c=cp, d=dtype, n=name: row(c, d, n)
        for cp in args.cps
        for dtype in (torch.bfloat16, torch.float32)
        for name in DOCS
    ]
    rows, complete = _rows(makers, time.monotonic() + budget)
    failed = [r for r in rows if not r["within"]]
    return _partial({"status": "failed" if failed else "ok", "rows": rows}, complete, rows)


def section_speed(args, budget: float) -> dict:
    from bench import speed_rows

    makers = [lambda n=n: speed_rows(args.speed_cp, [n], repeats=args.repeats)[0]
              for n in args.local_lens]  # fmt: skip
    rows, complete = _rows(makers, time.monotonic() + budget)
    return _partial({"status": "ok", "goal": "ratio <= 1.15", "rows": rows}, complete, rows)


def section_varlen(args, budget: float) -> dict:
    from bench import varlen_rows

    return {"status": "ok", "rows": varlen_rows(64, 16384, repeats=args.repeats)}


def _json_result(code: int | None, stdout: str, stderr: str, budget: float) -> dict:
    if code is None:
        return {"status": "timeout", "reason": f"past its budget of {budget:.0f} s",
                "log": (stdout + stderr)[-4000:]}  # fmt: skip
    if code != 0:
        return {"status": "failed", "log": (stdout + stderr)[-4000:]}
    try:
        return json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"status": "failed", "reason": "no JSON line last", "log": (stdout + stderr)[-4000:]}


def section_nccl(args, budget: float) -> dict:
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        return skipped(
            f"{gpus} GPU: the NCCL checks (cp_attention ring / all-gather on NCCL, cpvlm train "
            "--cp 2 against --cp 1) need 2 or more"
        )
    result = _json_result(*_run([sys.executable, str(HERE / "nccl_check.py")], budget), budget)
    if "status" in result:
        return result
    return {"status": "ok" if result.pop("ok") else "failed", **result}


def section_train(args, budget: float) -> dict:
    cmd = [sys.executable, str(HERE / "train_compare.py"), "--seq-len", str(args.seq_len)]
    cmd += ["--steps", str(args.train_steps), "--text-layers", str(args.text_layers)]
    cmd += ["--vision-depth", str(args.vision_depth)]
    result = _json_result(*_run(cmd, budget), budget)
    if "status" in result:
        return result
    return {"status": "ok", "goal": "step time ratio <= 1.10", **result}


RUN = {
    "tests": section_tests,
    "errors": section_errors,
    "speed": section_speed,
    "varlen": section_varlen,
    "nccl": section_nccl,
    "train": section_train,
}
IN_PROCESS = ("errors", "speed", "varlen")


@contextlib.contextmanager
def _alarm(seconds: float):
    """Raise SectionTimeout in this process after ``seconds`` (the in-process sections stop
    between rows at their budget; this is the backstop for a row that hangs)."""

    def fire(signum, frame):
        raise SectionTimeout

    before = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


# ---- reporting ---------------------------------------------------------------------------------


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 and v != 0 else f"{v:.3f}"
    return str(v)


def print_table(rows: list[dict], columns: list[str], title: str = "") -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c, ""))) for r in rows)) for c in columns]
    if title:
        print(title)
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)))


def report(name: str, result: dict) -> None:
    why = f" ({result['reason']})" if "reason" in result else ""
    print(f"== {name}: {result['status']}{why} in {result['seconds']} s")
    if "summary" in result:
        print(result["summary"])
        for reason in result.get("skip_reasons", []):
            print(f"  skipped: {reason}")
    rows = result.get("rows")
    if rows:
        print_table(rows, [c for c in rows[0] if not isinstance(rows[0][c], (list, dict))])
    for key in ("partial", "cpvlm", "hf", "ratios", "failed"):
        if key in result:
            print(f"{key}: {json.dumps(result[key])}")
    if result["status"] in ("failed", "timeout") and "log" in result:
        print(result["log"])


def _headline(result: dict) -> str:
    """One line a person reads first: the figure of each section."""
    if result["status"] == "skipped":
        return result.get("reason", "")
    rows = result.get("rows") or []
    if "summary" in result:
        text = result["summary"]
    elif "ratios" in result:
        text = ", ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items())
    elif rows and "within" in rows[0]:
        worst = max(max(v for k, v in r.items() if k in ("out", "dq", "dk", "dv")) for r in rows)
        text = (
            f"{sum(r['within'] for r in rows)}/{len(rows)} rows within tolerance, worst {worst:.2e}"
        )
    elif rows and "ratio" in rows[0]:
        text = "ratio " + ", ".join(f"{r['local_len']}: {r['ratio']:.2f}" for r in rows)
    elif rows and "per_document_over_varlen" in rows[0]:
        text = f"per-document / varlen {rows[0]['per_document_over_varlen']:.2f}x"
    else:
        text = result.get("reason", "")
    return text + (f" [{result['partial']}]" if "partial" in result else "")


def write(path: Path, results: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(path)


# ---- main --------------------------------------------------------------------------------------


def main() -> int:
    start = time.monotonic()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"),
                   help="the JSON file, rewritten after every section")  # fmt: skip
    p.add_argument("--deadline", type=float, default=500, help="seconds for everything")
    p.add_argument("--skip", nargs="*", default=[], choices=SECTIONS, help="sections to leave out")
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--speed-cp", type=int, default=2)
    p.add_argument("--local-lens", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=16384, help="train: tokens per step")
    p.add_argument("--train-steps", type=int, default=4)
    p.add_argument("--text-layers", type=int, default=8, help="train: decoder layers (2B: 28)")
    p.add_argument("--vision-depth", type=int, default=8, help="train: vision blocks (2B: 24)")
    p.add_argument("--requirements", action="store_true",
                   help="print the pins of what check.sh --wheels carries, and exit")  # fmt: skip
    args = p.parse_args()
    if args.requirements:
        print("\n".join(requirements()))
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    env, no_run = probe()
    if no_run is None:
        sys.path[:0] = [str(ROOT), str(HERE.parent), str(HERE)]
    results = {"environment": env, "deadline_s": args.deadline, "sections": {}}
    print(json.dumps(env))
    plan = [n for n in SECTIONS if n not in args.skip and no_run is None]
    if env.get("gpus", 0) < 2 and "nccl" in plan:
        plan.remove("nccl")  # it skips at once: no share of the time for it
    for name in SECTIONS:
        t0 = time.monotonic()
        left = args.deadline - RESERVE_S - (t0 - start)
        if name in args.skip:
            result = skipped("--skip")
        elif no_run is not None:
            result = skipped(no_run)
        elif left <= 0:
            result = skipped(f"the deadline ({args.deadline:.0f} s) was reached")
        else:
            budget = left * SHARES[name] / sum(SHARES[n] for n in plan)
            print(f"\n-- {name}: budget {budget:.0f} s of {left:.0f} s left", flush=True)
            result = _run_section(name, args, budget)
        if name in plan:
            plan.remove(name)
        result["seconds"] = round(time.monotonic() - t0, 1)
        results["sections"][name] = result
        results["seconds"] = round(time.monotonic() - start, 1)
        write(out, results)
        report(name, result)

    statuses = [
        {"section": n, "status": r["status"], "seconds": r["seconds"], "result": _headline(r)}
        for n, r in results["sections"].items()
    ]
    print()
    print_table(statuses, ["section", "status", "seconds", "result"], title="summary")
    print(f"wrote {out} ({results['seconds']:.0f} s of {args.deadline:.0f})")
    wheels = env.get("wheels")
    if wheels is not None:
        print(f"libraries: {json.dumps(env['libraries'])}")
        if not wheels["installed"]:
            print(f"the wheels of {wheels['dir']} were not installed: {wheels['error']}")
            return 1
    return 1 if any(s["status"] in ("failed", "timeout") for s in statuses) else 0


def _run_section(name: str, args, budget: float) -> dict:
    try:
        if name in IN_PROCESS:
            with _alarm(budget + 30):
                result = RUN[name](args, budget)
        else:
            result = RUN[name](args, budget)
    except SectionTimeout:
        result = {"status": "timeout", "reason": f"a row ran past the budget of {budget:.0f} s"}
    except Exception:  # noqa: BLE001 (one failed section must not lose the others)
        result = {"status": "failed", "log": traceback.format_exc()[-4000:]}
    if name in IN_PROCESS:
        import torch

        torch.cuda.empty_cache()
    return result


if __name__ == "__main__":
    sys.exit(main())
