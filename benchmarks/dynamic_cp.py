"""Dynamic CP against static CP on long-tailed steps: modelled GPU step time, measured CPU tokens/s.

    python benchmarks/dynamic_cp.py                  # --part modelled: about a minute
    python benchmarks/dynamic_cp.py --part cpu       # 4 to 15 minutes: cpvlm train, world 4

Part "modelled" (``dynamic_cp.json``): the step of one DP replica (dp 1, world = cp) of
Qwen3-VL-8B's published config at cp 8, 16 and 64, the longest row ``PER_RANK`` x cp tokens
(16k a rank), R = 16 and 64 rows a step, on the two mixes of ``cpvlm.simulate.dynamic_cp``: text
(log-normal lengths, median 1/64 of the longest) and video (one row in 16 a video filling the
longest row, the rest short image conversations). Each row costs ``RowCost`` (forward MACs) and
runs as ``JobTimes`` models it with the cost model's published H100 figures (the attention
kernel's ~350 TFLOP/s for every matrix product, 20 us a message, 200 GB/s NVLink, 10 us a
kernel call; FSDP2's gathers of a round from ``parallel_cost.fsdp_seconds``): static CP runs each
row over all cp ranks, one round a row; dynamic CP is ``plan_dynamic_cp`` with those times and
the memory rule's budget (ceil(longest / cp) tokens of a row a rank, so the peak memory per rank
is static CP's by construction). Columns: modelled step seconds both ways and their ratio, the
ideal (every row's compute spread evenly over the cp ranks, nothing else), rounds, rows per CP
size, the modelled balance (busy rank-time over the group's), the speedup again without a
round's costs (FSDP2's gathers and fixed costs set to 0: what is left once packing rows into
fewer rounds gains nothing), and the host time of the planner
(process time, best of ``REPEATS``) at R = 16, 64 and 256 rows.

Part "cpu" (``dynamic_cp_cpu.json``): measured, ``cpvlm train`` as a user starts it, world 4 on
this machine's CPU cores (gloo, float32, the tiny Qwen3-VL checkpoint, one sample a row:
``--pack-window 1``, ``--grad-accum ROWS`` rows a step, ``--no-shuffle``), static ``--cp 4``
and ``--cp 4 --dynamic-cp`` run one after the other on the same data in one invocation, on two
long-tailed mixes of JSONL conversations: text (log-normal lengths up to the row) and video (a
few long videos of JPEG frames beside many short conversations about one image). tokens/s is the
median over the steps after ``WARMUP`` of ``tokens_per_s`` in ``metrics.jsonl``; the dynamic
run's ``dynamic_cp`` record (rows per c, rounds, modelled balance) is kept.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from _common import parser, print_table, write_json

MODEL = "qwen3-vl-8b"
CPS = [8, 16, 64]
ROWS = [16, 64]
HOST_ROWS = [16, 64, 256]
PER_RANK = 16384  # tokens of the longest row per rank
REPEATS = 5

CPU_SEQ_LEN = 2048
CPU_ROWS = 16
CPU_STEPS = 5
WARMUP = 2
IMAGE_SIDE, VIDEO_FRAMES, VIDEO_SIDE = 112, 16, 224
VIDEO_PIXELS = VIDEO_FRAMES * VIDEO_SIDE**2  # the whole video at full size: ~1.6k tokens


def modelled_main(args) -> None:
    from cpvlm.data.dynamic_cp import plan_dynamic_cp
    from cpvlm.hf.data.row_cost import row_cost
    from cpvlm.simulate.configs import load_config
    from cpvlm.simulate.dynamic_cp import MIXES, compare, job_times

    config = load_config(MODEL)
    cost = row_cost(config)
    rows = []
    for mix, make in MIXES.items():
        for cp in CPS:
            for r in ROWS:
                seq_len = PER_RANK * cp
                metas = make(seq_len, r)
                result = compare(config, metas, seq_len, cp).as_dict()
                # the same without a round's costs: what packing rows into rounds gains
                free = replace(job_times(config, cp), gather_s=0.0, round_s=0.0)
                rest = compare(config, metas, seq_len, cp, times=free)
                result.update(mix=mix, seq_len=seq_len, no_round_speedup=rest.speedup)
                result["rows per c"] = " ".join(f"{c}:{n}" for c, n in result["sizes"].items())
                rows.append(result)
    host = []
    for cp in CPS:
        times = job_times(config, cp)
        for r in HOST_ROWS:
            seq_len = PER_RANK * cp
            for mix, make in MIXES.items():
                metas = make(seq_len, r)
                tokens, costs = [m.tokens for m in metas], [cost.sample(m) for m in metas]
                best = []
                for _ in range(REPEATS):
                    start = time.process_time()
                    plan_dynamic_cp(tokens, costs, cp, -(-seq_len // cp), times=times)
                    best.append(time.process_time() - start)
                host.append({"mix": mix, "cp": cp, "rows": r, "plan_ms": min(best) * 1e3})
    print_table(
        rows,
        ["mix", "cp", "rows", "static_s", "dynamic_s", "speedup", "no_round_speedup", "ideal_s"]
        + ["rounds", "balance", "rows per c"],
        f"{MODEL}, modelled (H100 figures): one DP replica's step, the longest row "
        f"{PER_RANK} x cp tokens",
    )
    print_table(host, ["mix", "cp", "rows", "plan_ms"], "planner host time (process time, best)")
    write_json(
        args.out_dir,
        "dynamic_cp",
        {
            "config": {
                "model": MODEL,
                "per_rank_tokens": PER_RANK,
                "figures": "cpvlm.attention.cost.CUDA_NCCL (published H100), modelled",
                "load_average": os.getloadavg()[0],
                "repeats": REPEATS,
            },
            "modelled": rows,
            "host": host,
        },
    )


def _photo(path: Path, h: int, w: int, seed: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path, quality=90)


def _conversation(content: list, answer: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
    }


def make_mix(root: Path, mix: str, samples: int) -> Path:
    """JSONL of ``samples`` conversations: text (log-normal word counts, median ~1/20 of the row,
    capped at the row) or video (one in 8 a 16-frame video of 224 x 224 JPEGs, ~1.6k tokens of
    the tiny model, the others one 112 x 112 image, 49 tokens, and a short question)."""
    from cpvlm.simulate.dynamic_cp import lognormal_quantiles

    root.mkdir(parents=True, exist_ok=True)
    records = []
    words = lognormal_quantiles(samples, CPU_SEQ_LEN / 20, 1.5)
    for i in range(samples):
        if mix == "text":
            n = min(CPU_SEQ_LEN - 64, max(4, round(words[(i * 7) % samples])))
            records.append(_conversation([{"type": "text", "text": "word " * n}], "yes."))
        elif i % 8 == 0:
            for f in range(VIDEO_FRAMES):
                _photo(root / f"vid{i}" / f"{f:05d}.jpg", VIDEO_SIDE, VIDEO_SIDE, seed=i * 100 + f)
            video = {"type": "video", "video": f"vid{i}", "fps": 2.0}
            records.append(_conversation([video, {"type": "text", "text": "What happens?"}], "x"))
        else:
            _photo(root / f"img{i}.jpg", IMAGE_SIDE, IMAGE_SIDE, seed=i)
            image = {"type": "image", "image": f"img{i}.jpg"}
            text = {"type": "text", "text": "Describe it. " * (1 + i % 5)}
            records.append(_conversation([image, text], "Noise. " * (1 + i % 3)))
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def train(ckpt: Path, data: Path, dynamic: bool, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="cpvlm-bench-dyncp-") as tmp:
        out = Path(tmp) / "run"
        cmd = [
            sys.executable, "-m", "cpvlm.train", "--model", str(ckpt), "--data", str(data),
            "--cp", "4", "--seq-len", str(CPU_SEQ_LEN), "--pack-window", "1",
            "--grad-accum", str(CPU_ROWS), "--steps", str(steps), "--no-shuffle",
            "--max-pixels", str(IMAGE_SIDE**2), "--video-max-pixels", str(VIDEO_PIXELS),
            "--device", "cpu", "--out", str(out),
        ] + (["--dynamic-cp"] if dynamic else [])  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd[1:])} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def cpu_main(args) -> None:
    from cpvlm.hf.tiny_checkpoint import make_tiny_checkpoint

    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="cpvlm-bench-dyncp-data-") as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "ckpt", "qwen3_vl")
        for mix in ("text", "video"):
            data = make_mix(Path(tmp) / mix, mix, CPU_ROWS * args.steps)
            runs = {name: train(ckpt, data, name == "dynamic", args.steps) for name in RUNS}
            steady = {name: records[WARMUP:] for name, records in runs.items()}
            tok = {n: statistics.median(r["tokens_per_s"] for r in s) for n, s in steady.items()}
            rows.append(
                {
                    "mix": mix,
                    "static tok/s": tok["static"],
                    "dynamic tok/s": tok["dynamic"],
                    "ratio": tok["dynamic"] / tok["static"],
                    "static s/step": statistics.median(r["step_time_s"] for r in steady["static"]),
                    "dynamic s/step": statistics.median(
                        r["step_time_s"] for r in steady["dynamic"]
                    ),
                    "dynamic_cp": [r.get("dynamic_cp") for r in runs["dynamic"]],
                }
            )
    load_after = os.getloadavg()
    print_table(
        rows,
        ["mix", "static tok/s", "dynamic tok/s", "ratio", "static s/step", "dynamic s/step"],
        f"cpvlm train, world 4 (cp 4), tiny Qwen3-VL, {CPU_ROWS} rows of up to {CPU_SEQ_LEN} "
        f"tokens a step, load average {load_before[0]:.1f} -> {load_after[0]:.1f}",
    )
    write_json(
        args.out_dir,
        "dynamic_cp_cpu",
        {
            "config": {
                "seq_len": CPU_SEQ_LEN,
                "rows_per_step": CPU_ROWS,
                "steps": args.steps,
                "warmup_steps": WARMUP,
                "load_average_before": load_before,
                "load_average_after": load_after,
            },
            "rows": rows,
        },
    )


RUNS = ("static", "dynamic")
PARTS = {"modelled": modelled_main, "cpu": cpu_main}


def main():
    p = parser(__doc__)
    p.add_argument("--part", choices=list(PARTS), default="modelled", help="see the docstring")
    p.add_argument("--steps", type=int, default=CPU_STEPS, help="cpu: steps a run")
    args = p.parse_args()
    if args.steps <= WARMUP:
        p.error(f"--steps must be more than the {WARMUP} warm-up steps")
    PARTS[args.part](args)


if __name__ == "__main__":
    main()
