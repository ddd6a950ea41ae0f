"""``cpvlm train`` at CP=1 on one GPU against the plain Hugging Face model on the same sample.

    python benchmarks/gpu/train_compare.py [--seq-len 16384] [--steps 4] [--text-layers 28]

A Qwen3-VL-2B-sized model (text 2048 x 28 layers, 16/8 heads of 128, vocab 151936; vision 1024 x
24 blocks, deepstack 5/11/17) with random weights, bf16, or one as wide with fewer layers
(--text-layers, --vision-depth: what check.py runs, so that the saved model and the run's final
checkpoint stay a few GB), is saved to a temporary directory (a RAM disk where one has room) and
deleted at the end. Then, one after the other on the same GPU:
  cpvlm  ``python -m cpvlm.cli train --cp 1 --model DIR --dtype bfloat16 --param-dtype bfloat16 --seq-len S`` with one
         S-token document per step (benchmarks/gpu/long_sample.py); its metrics.jsonl gives the
         step time and the peak memory (torch.cuda.max_memory_allocated, reset every step);
  hf     the model loaded from DIR, SDPA attention, on the same packed row: forward with labels,
         backward, gradient clipping and AdamW, as the trainer's step does; the same figures.
Steps after the first are kept (the first pays for allocation and autotuning); the medians are
compared. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

TEXT = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
    rms_norm_eps=1e-6, hidden_act="silu",
    rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                     "mrope_section": [24, 20, 20], "mrope_interleaved": True},
)  # fmt: skip
VISION = dict(
    depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, in_channels=3,
    patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2048,
    num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17],
    hidden_act="gelu_pytorch_tanh",
)  # fmt: skip
TOKENS = dict(
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
    vision_end_token_id=151653,
)  # fmt: skip


def save_random_model(path: Path, text_layers: int, vision_depth: int) -> None:
    from transformers import AutoModelForImageTextToText, Qwen3VLConfig

    text = dict(TEXT, num_hidden_layers=text_layers)
    # Deepstack taps at the same relative depths as the 2B model's 5/11/17 of 24.
    taps = sorted({min(vision_depth - 1, round(i * vision_depth / 24)) for i in (5, 11, 17)})
    vision = dict(VISION, depth=vision_depth, deepstack_visual_indexes=taps)
    config = Qwen3VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True, **TOKENS
    )
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()


def run_cpvlm(model_dir: Path, out: Path, seq_len: int, steps: int) -> list[dict]:
    env = dict(os.environ, CPVLM_GPU_SEQ_LEN=str(seq_len))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "cpvlm.cli", "train", "--cp", "1", "--model", str(model_dir)]
    # Pure bf16 (parameters and optimizer state too), as the plain model below is loaded.
    cmd += ["--dtype", "bfloat16", "--param-dtype", "bfloat16"]
    cmd += ["--seq-len", str(seq_len), "--batch-size", "1"]
    cmd += ["--steps", str(steps), "--device", "cuda", "--data", "long_sample:samples"]
    cmd += ["--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=sys.stderr)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def run_hf(model_dir: Path, seq_len: int, steps: int) -> list[dict]:
    from long_sample import samples
    from transformers import AutoModelForImageTextToText

    from cpvlm.train.config import OptimConfig

    model = AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa", local_files_only=True
    ).cuda()
    model.train()
    optim = OptimConfig()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay)
    # The one S-token sample as one row, labels = ids (cpvlm trains every token of a sample
    # without a chat template's assistant turns).
    (sample,) = samples(model.config, seed=0, seq_len=seq_len)
    ids = sample["input_ids"].view(1, -1)
    batch = {
        "input_ids": ids.cuda(),
        "labels": ids.cuda(),
        "pixel_values": sample["pixel_values"].to("cuda", torch.bfloat16),
        "image_grid_thw": sample["image_grid_thw"].cuda(),
    }
    records = []
    for _ in range(steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        if optim.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, optim.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        records.append(
            {"step_time_s": seconds, "tokens_per_s": seq_len / seconds,
             "mem_peak_mib": torch.cuda.max_memory_allocated() / 2**20, "loss": loss.item()}
        )  # fmt: skip
    return records


def _summary(records: list[dict]) -> dict:
    kept = records[1:] or records
    return {
        key: statistics.median(r[key] for r in kept)
        for key in ("step_time_s", "tokens_per_s", "mem_peak_mib")
    }


def _scratch_root() -> str | None:
    """A RAM disk with room for the model and the run's final checkpoint (~16 GB at 2B size),
    else the default temporary directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 40 * 2**30:
        return str(shm)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--text-layers", type=int, default=TEXT["num_hidden_layers"])
    p.add_argument("--vision-depth", type=int, default=VISION["depth"])
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("train_compare.py needs a CUDA device")
    tmp = Path(tempfile.mkdtemp(prefix="cpvlm-gpu-", dir=_scratch_root()))
    try:
        t0 = time.perf_counter()
        save_random_model(tmp / "model", args.text_layers, args.vision_depth)
        saved_s = time.perf_counter() - t0
        cpvlm = _summary(run_cpvlm(tmp / "model", tmp / "run", args.seq_len, args.steps))
        hf = _summary(run_hf(tmp / "model", args.seq_len, args.steps))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ratios = {
        "step_time": cpvlm["step_time_s"] / hf["step_time_s"],
        "peak_memory": cpvlm["mem_peak_mib"] / hf["mem_peak_mib"],
    }
    print(json.dumps({"seq_len": args.seq_len, "steps": args.steps, "model_save_s": saved_s,
                      "text_layers": args.text_layers, "vision_depth": args.vision_depth,
                      "cpvlm": cpvlm, "hf": hf, "ratios": ratios}))  # fmt: skip


if __name__ == "__main__":
    main()
