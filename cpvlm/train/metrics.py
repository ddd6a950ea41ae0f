"""What rank 0 shows and writes: a progress bar, ``metrics.jsonl``, and the end-of-run summary.

``metrics.jsonl`` holds one JSON object per step: ``step`` (1-based), ``loss`` (the step's mean
loss over its valid labels, all DP ranks and microbatches), ``tokens_per_s`` (real tokens of the
global batch / step wall time), ``step_time_s``, ``grad_norm`` (before clipping), ``lr``,
``tokens``, ``valid_labels``, ``rows``, ``rows_text_only``, ``ranks`` (dp * cp),
``data_time_s`` (rank 0's wait for its rows, and the agreement on decode failures),
``bad_samples`` (skipped while planning the step's rows), ``rows_replaced`` (rows whose images
failed to decode, trained as rows without labels), ``truncated`` (text samples cut), and
``ranks_no_image`` / ``ranks_no_visual_tokens``: ranks that, in a step whose rows hold images or
videos, encoded no vision unit / held no visual token in their shards; ``mem_start_mib`` /
``mem_peak_mib``: the memory a rank held when the step began / its peak during the step, max over
ranks, in MiB (see ``StepMemory``); ``attn_impl``: the CP attention the step's rows ran (with
``--attn auto``, what the cost model picked, e.g. ``"ring"`` or ``"hybrid 2x2"``; comma-separated
when rows differ); ``skipped_nonfinite``: the step's loss or gradient norm was not finite and
``--skip-nonfinite`` skipped its update.

The summary's ``tokens_per_s`` is the run's tokens over its steps' time (every step of this
process, the first one's set-up included); ``tokens_per_s_after_first`` leaves the first out.
"""

from __future__ import annotations

import json
import resource
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
MiB = 2**20


class StepMemory:
    """One rank's memory at the start of a step and its peak during the step, in MiB.

    CUDA: bytes held by tensors (``torch.cuda.memory_allocated`` / ``max_memory_allocated``, the
    peak reset at each step). CPU has no allocator counter, so the figure is the process's
    resident memory: VmRSS and VmHWM from /proc/self/status, the high-water mark reset at each
    step through /proc/self/clear_refs (Linux); elsewhere the peak is the process's lifetime
    ``ru_maxrss`` and the start is 0. RSS also holds the interpreter, the libraries, the model and
    memory the allocator keeps after frees, so compare it across runs, not as activation bytes.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def start(self) -> float:
        """Reset the peak; returns the memory held now."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device) / MiB
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # 5: reset the peak RSS (VmHWM) to the current RSS
            return self._proc_status("VmRSS")
        except OSError:
            return 0.0

    def peak(self) -> float:
        """The peak since ``start``."""
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / MiB
        try:
            return self._proc_status("VmHWM")
        except OSError:
            scale = 1 if sys.platform == "darwin" else 1024  # macOS: bytes; Linux: KiB
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / MiB

    @staticmethod
    def _proc_status(key: str) -> float:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024 / MiB
        raise OSError(f"no {key} in /proc/self/status")


class MetricsLog:
    """Appends one JSON line per step; on resume, drops the lines after the checkpoint's step."""

    def __init__(self, out: str | Path, *, start_step: int = 0):
        self.path = Path(out) / METRICS
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if start_step and self.path.exists():
            kept = [r for r in self.read() if r["step"] <= start_step]
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]


class Progress:
    """A tqdm bar on a terminal; otherwise about 20 plain lines per run (logs stay readable)."""

    def __init__(self, total: int, start: int):
        self.total = total
        self.interactive = sys.stderr.isatty()
        self.every = max(1, (total - start) // 20)
        self.bar = (
            tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
            if self.interactive
            else None
        )

    def update(self, r: dict) -> None:
        text = (
            f"loss {r['loss']:.4f}  {r['tokens_per_s']:,.0f} tok/s  {r['step_time_s']:.2f} s/step"
        )
        if "dynamic_cp" in r:  # rows per CP size, rounds: "cp 1x3 2x1 4x1 in 3 rounds"
            d = r["dynamic_cp"]
            sizes = " ".join(f"{c}x{n}" for c, n in d["sizes"].items() if n)
            text += f"  cp {sizes} in {d['rounds']} rounds"
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif r["step"] % self.every == 0 or r["step"] == self.total or r["step"] == 1:
            print(f"step {r['step']:>{len(str(self.total))}}/{self.total}  {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _picks(steps: dict[str, int]) -> str:
    """``auto``'s choices: "picked ring in 8 steps, ulysses in 2"."""
    ranked = sorted(steps.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = [f"{name} in {n} step{'s' * (n != 1)}" for name, n in ranked]
    return "picked " + ", ".join(parts)


def _rate(records: list[dict]) -> float:
    seconds = sum(r["step_time_s"] for r in records)
    return sum(r["tokens"] for r in records) / seconds if seconds > 0 else float("nan")


def _vision_line(summary: dict, vision_steps: int, ranks: int) -> str:
    if not vision_steps:
        return "  vision          no step had images or videos (text-only data)"
    return (
        f"  vision          in {summary['steps_with_a_rank_without_images']} of "
        f"{vision_steps} steps with images, a rank encoded none (mean "
        f"{summary['mean_ranks_without_images']:.2f} of {ranks} ranks); in "
        f"{summary['steps_with_a_rank_without_visual_tokens']} a rank held no visual token "
        f"(mean {summary['mean_ranks_without_visual_tokens']:.2f})"
    )


def summarize(config, records: list[dict], start_step: int, log: MetricsLog, errors=None) -> dict:
    """Print the summary of this run (all steps in metrics.jsonl) and write summary.json."""
    everything = log.read()
    losses = [r["loss"] for r in everything if not r.get("skipped_nonfinite")]
    k = max(1, min(3, len(losses) // 3))
    vision_steps = [r for r in everything if r["rows"] > r["rows_text_only"]]
    no_image = [r["ranks_no_image"] for r in vision_steps]
    no_tokens = [r["ranks_no_visual_tokens"] for r in vision_steps]
    ranks = records[-1]["ranks"] if records else config.parallel.world_size
    steady = records[1:] or records  # the first step of a process pays one-time setup
    summary = {
        "steps": len(everything),
        "resumed_from": start_step,
        "loss_first": _mean(losses[:k]),
        "loss_last": _mean(losses[-k:]),
        "tokens_per_s": _rate(records),
        "tokens_per_s_after_first": _rate(records[1:]),
        "step_time_s": _mean([r["step_time_s"] for r in steady]),
        "train_time_s": sum(r["step_time_s"] for r in records),
        "data_time_share": sum(r.get("data_time_s", 0.0) for r in steady)
        / max(sum(r["step_time_s"] for r in steady), 1e-12),
        "mem_peak_mib": max((r["mem_peak_mib"] for r in records), default=float("nan")),
        "ranks": ranks,
        "steps_skipped_nonfinite": sum(bool(r.get("skipped_nonfinite")) for r in everything),
        "steps_with_images": len(vision_steps),
        "steps_with_a_rank_without_images": sum(n > 0 for n in no_image),
        "mean_ranks_without_images": _mean(no_image),
        "steps_with_a_rank_without_visual_tokens": sum(n > 0 for n in no_tokens),
        "mean_ranks_without_visual_tokens": _mean(no_tokens),
        "bad_samples": errors.summary() if errors is not None else {},
        "rows_replaced": sum(r.get("rows_replaced", 0) for r in everything),
        "truncated_samples": sum(r.get("truncated", 0) for r in everything),
        "out": str(log.path.parent),
        "attn_impl_steps": dict(Counter(r.get("attn_impl", "") for r in everything)),
    }
    with open(log.path.parent / SUMMARY, "w") as f:
        json.dump(summary, f, indent=1)
    p, m = config.parallel, config.model
    precision = f"{m.dtype} on {m.master_dtype} parameters" if m.mixed_precision else m.dtype
    lines = [
        f"done: {summary['steps']} steps of {m.name} ({precision}), "
        f"cp {p.cp} x dp {p.dp}{f' x tp {p.tp}' if p.tp > 1 else ''} = {ranks} ranks, seq-len {config.data.seq_len}, "
        f"{config.rows_per_step} row{'s' if config.rows_per_step != 1 else ''} per step, "
        f"attn {p.attn}"
        + (f" {p.ulysses_size}x{p.cp // p.ulysses_size}" if p.attn == "hybrid" else "")
        + (f" ({_picks(summary['attn_impl_steps'])})" if p.attn == "auto" else "")
        + f", layout {p.layout}"
        + (f", resumed at step {start_step}" if start_step else ""),
        f"  loss            {summary['loss_first']:.4f} -> {summary['loss_last']:.4f} "
        f"(mean of the first / last {k} steps)",
        f"  throughput      {summary['tokens_per_s']:,.0f} tokens/s (tokens / time of the "
        f"{len(records)} steps of this run; {summary['tokens_per_s_after_first']:,.0f} after "
        f"the first), {summary['step_time_s']:.3f} s/step, "
        f"{summary['data_time_share']:.0%} of it waiting for data",
        f"  memory          peak {summary['mem_peak_mib']:,.0f} MiB on a rank (GPU: tensors; "
        "CPU: the process's resident set)",
        _vision_line(summary, len(vision_steps), ranks),
    ]
    if summary["steps_skipped_nonfinite"]:
        lines.append(
            f"  skipped         {summary['steps_skipped_nonfinite']} steps with a non-finite "
            f"loss or gradient norm (--skip-nonfinite {config.run.skip_nonfinite})"
        )
    bad = summary["bad_samples"]
    if bad or summary["truncated_samples"]:
        skipped = ", ".join(f"{n} {reason}" for reason, n in bad.items()) or "none"
        lines.append(
            f"  data            skipped {sum(bad.values())} bad samples ({skipped}; see "
            f"{Path(summary['out']) / 'data_errors.jsonl'}), {summary['rows_replaced']} rows "
            f"replaced, {summary['truncated_samples']} text samples cut to --seq-len"
        )
    lines.append(
        f"  outputs         {log.path} ; checkpoints in {Path(summary['out']) / 'checkpoints'}"
    )
    print("\n".join(lines), flush=True)
    return summary
