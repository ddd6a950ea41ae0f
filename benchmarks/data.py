"""The data path: loader samples/s at CP 1/2/4, decoding split vs decoding everything, and the
loader's share of step time in ``cpvlm train``.

    python benchmarks/data.py            # about 4 minutes on 2 idle CPU cores
    python benchmarks/data.py --samples 8 --repeats 1 --cp 1 2 --train-steps 3 --train-workers 0 \
        --out-dir DIR  # a trial run

Data that looks real: JPEG photos (smooth gradients with noise, so that they decode like
photographs) of 320x240 to 1920x1080 pixels, one to three per conversation, a 16-frame video
(a folder of 320x240 JPEG frames) in one sample in five, text-only samples, one or two turns;
the tiny Qwen3-VL checkpoint of ``cpvlm.hf.tiny_checkpoint`` with images resized to at most
448x448 pixels (3136 patches of 8 pixels) and videos to at most 4 frames' worth of that.

Part 1, the loader alone (``RankLoader``, no model): every CP rank of a group is run in turn in
this process, without workers, for the same steps (one packed row of 4096 tokens a step); the
group's samples/s is the samples of those steps over the slowest rank's time (the ranks run in
parallel in training), best of 3 runs interleaved (the machine is shared). "split" decodes on each rank only the images and frames it encodes
(``--decode local``, the default); "all" decodes everything on every rank (``--decode all``,
what a loader that hands every rank the full batch does). Each rank still plans every sample
(tokens, grids from image headers), so the planning cost is in both columns; plan_s is that
part alone (the same steps planned without decoding).

Part 2, ``cpvlm train`` on the same data (tiny model, float32, CP 2, 8 steps): the share of the
step time a rank spends waiting for its rows (``data_time_s`` / ``step_time_s`` of
``metrics.jsonl``, steps after the first two), with 0 and 2 DataLoader workers per rank. The
tiny model's step is cheap, so this share is an upper bound for a real model on the same data.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import parser, print_table, write_json

SIZES = [(240, 320), (480, 640), (768, 1024), (960, 1280), (1080, 1920)]
VIDEO_FRAMES, VIDEO_SIZE = 16, (240, 320)
SAMPLES = 40
SEQ_LEN = 4096
STEPS = 4
REPEATS = 3
MAX_PIXELS = 448 * 448
VIDEO_MAX_PIXELS = 4 * 448 * 448
TRAIN_STEPS, WARMUP = 8, 2


def _photo(path: Path, h: int, w: int, rng) -> None:
    from PIL import Image

    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x / w, y / h, (x + y) / (w + h)], axis=-1) * 200
    pixels = np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, quality=90)


def make_data(root: Path, samples: int) -> Path:
    rng = np.random.default_rng(0)
    records = []
    for i in range(samples):
        content = []
        if i % 5 == 4:
            for f in range(VIDEO_FRAMES):
                _photo(root / f"vid{i}" / f"{f:05d}.jpg", *VIDEO_SIZE, rng)
            content.append({"type": "video", "video": f"vid{i}", "fps": 2.0})
        elif i % 5 != 0:
            for k in range(1 + i % 3):
                h, w = SIZES[int(rng.integers(len(SIZES)))]
                _photo(root / f"img{i}_{k}.jpg", h, w, rng)
                content.append({"type": "image", "image": f"img{i}_{k}.jpg"})
        content.append({"type": "text", "text": "Describe what you see. " * (1 + i % 4)})
        answer = "A smooth gradient with some noise, mostly blue and green. " * (1 + i % 3)
        messages = [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
        records.append({"messages": messages})
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _time_rank(encoder, source, cp: int, rank: int, mode: str | None):
    """Seconds for one rank's STEPS steps, media it decoded, samples; mode None: planning only."""
    from cpvlm.data import LoaderConfig, RankLoader, RowStream

    stream = RowStream(source, encoder.plan, seq_len=SEQ_LEN, window=64, seed=0)
    t0 = time.perf_counter()
    if mode is None:
        rows = stream.rows()
        docs = sum(len(next(rows).row.docs) for _ in range(STEPS))
        return time.perf_counter() - t0, 0, docs
    config = LoaderConfig(cp_rank=rank, cp_size=cp, decode_mode=mode)
    loader = RankLoader(stream, encoder.decode, encoder.ids, config)
    rows = [r for _ in range(STEPS) for r in loader.next_step()]
    seconds = time.perf_counter() - t0
    return seconds, sum(len(r.decoded) for r in rows), sum(len(r.doc_lens) for r in rows)


def loader_rows(ckpt: Path, jsonl: Path, cps: list[int], repeats: int) -> list[dict]:
    from transformers import AutoConfig

    from cpvlm.data import open_source
    from cpvlm.hf.data.processor import ChatEncoder

    encoder = ChatEncoder(
        ckpt,
        AutoConfig.from_pretrained(ckpt),
        max_pixels=MAX_PIXELS,
        video_max_pixels=VIDEO_MAX_PIXELS,
    )
    source = open_source(str(jsonl))
    _time_rank(encoder, source, 1, 0, "all")  # warm caches (template, file system) once
    cases = [(cp, rank, mode) for cp in cps for rank in range(cp) for mode in ("local", "all")]
    best: dict = {}
    for _ in range(repeats):  # interleaved, best of the repeats: the machine is shared
        plan_s = _time_rank(encoder, source, 1, 0, None)[0]
        best["plan"] = min(best.get("plan", plan_s), plan_s)
        for case in cases:
            seconds, decoded, samples = _time_rank(encoder, source, *case)
            prev = best.get(case)
            best[case] = (min(prev[0], seconds) if prev else seconds, decoded, samples)
    out = []
    for cp in cps:
        slowest = {}
        for mode in ("local", "all"):
            per_rank = [best[cp, r, mode] for r in range(cp)]
            slowest[mode] = max(t for t, _, _ in per_rank)
            decoded = [d for _, d, _ in per_rank]
            out.append(
                {
                    "cp": cp,
                    "decode": "split" if mode == "local" else "all",
                    "samples_per_s": per_rank[0][2] / slowest[mode],
                    "slowest_rank_s": slowest[mode],
                    "plan_s": best["plan"],
                    "decoded_per_rank_max": max(decoded),
                    "decoded_per_rank_mean": statistics.mean(decoded),
                    "decoded_total": sum(decoded),
                }
            )
        out[-2]["x_all"] = slowest["all"] / slowest["local"]
    return out


def train_rows(ckpt: Path, jsonl: Path, steps: int, worker_counts: list[int]) -> list[dict]:
    out = []
    for workers in worker_counts:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable, "-m", "cpvlm.train", "--model", str(ckpt), "--data", str(jsonl),
                "--cp", "2", "--steps", str(steps), "--seq-len", str(SEQ_LEN),
                "--max-pixels", str(MAX_PIXELS), "--video-max-pixels", str(VIDEO_MAX_PIXELS),
                "--num-workers", str(workers), "--out", str(Path(tmp) / "run"),
            ]  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True)
            lines = (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
        steps = [json.loads(x) for x in lines][WARMUP:]
        data = sum(r["data_time_s"] for r in steps)
        total = sum(r["step_time_s"] for r in steps)
        out.append(
            {
                "workers": workers,
                "step_time_s": total / len(steps),
                "data_time_s": data / len(steps),
                "data_share": data / total,
            }
        )
    return out


def main():
    from cpvlm.hf.tiny_checkpoint import make_tiny_checkpoint

    p = parser(__doc__)
    p.add_argument("--samples", type=int, default=SAMPLES, help="conversations in the data")
    p.add_argument("--repeats", type=int, default=REPEATS, help="loader runs, best of")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="loader: CP sizes")
    p.add_argument("--train-steps", type=int, default=TRAIN_STEPS)
    p.add_argument("--train-workers", type=int, nargs="+", default=[0, 2])
    args = p.parse_args()
    if args.train_steps <= WARMUP:
        p.error(f"--train-steps must be more than the {WARMUP} warm-up steps")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="cpvlm-bench-data-") as tmp:
        root = Path(tmp)
        ckpt = make_tiny_checkpoint(root / "ckpt", "qwen3_vl")
        jsonl = make_data(root / "data", args.samples)
        loader = loader_rows(ckpt, jsonl, args.cp, args.repeats)
        train = train_rows(ckpt, jsonl, args.train_steps, args.train_workers)
    load_after = os.getloadavg()
    print_table(
        loader,
        [
            "cp",
            "decode",
            "samples_per_s",
            "x_all",
            "slowest_rank_s",
            "plan_s",
            "decoded_per_rank_max",
            "decoded_per_rank_mean",
            "decoded_total",
        ],  # fmt: skip
        title="Loader alone (per CP group; x_all = time of 'all' over 'split' at the same cp)",
    )
    print()
    print_table(train, ["workers", "step_time_s", "data_time_s", "data_share"],
                title="cpvlm train, CP 2: the share of step time spent waiting for rows")  # fmt: skip
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    write_json(
        args.out_dir,
        "data",
        {"loader": loader, "train": train, "load_avg_before": load_before,
         "load_avg_after": load_after},
    )  # fmt: skip


if __name__ == "__main__":
    main()
