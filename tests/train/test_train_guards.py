"""Non-finite steps and the run's report.

A run whose loss or gradient norm turns non-finite stops at that step with one line naming it,
writes no checkpoint of it and exits 1; ``--skip-nonfinite N`` skips up to N such steps (no
update) and counts them. A text-only run reports no vision figures (no "nan"), and tokens/s is
the run's tokens over its time.
"""

import json
import math

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from cpvlm.train.command import main as train_main


def _run(out, *flags):
    return train_main(["--out", str(out), "--seq-len", "64", "--ckpt-every", "1", *flags])


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_diverging_learning_rate_stops_at_the_step_it_breaks(tmp_path, capsys):
    """--lr 1e38: step 1 is finite, its update overflows float32 weights, so step 2's loss is not.
    (--lr inf itself is refused before anything starts: see test_train_config.)"""
    out = tmp_path / "run"
    flags = ["--cp", "2", "--steps", "5", "--data", "_train_sources:text_only"]
    assert _run(out, *flags, "--lr", "1e38") == 1
    captured = capsys.readouterr()
    assert captured.out.startswith(f"cpvlm train: output in {out}")
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("cpvlm train: stopped at step 2: the loss is nan"), last
    assert f"the last checkpoint is {out / 'checkpoints' / 'step_00000001'}" in last
    assert "--skip-nonfinite N skips up to N such steps" in last
    assert [r["step"] for r in _metrics(out)] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]


def test_a_nan_pixel_is_skipped_with_skip_nonfinite(tmp_path):
    """Sample 2 (the row of step 3: in order, one sample a row) has a NaN pixel; with --skip-nonfinite 1 step 3 is skipped
    and training goes on with finite losses. The run is mixed precision (--dtype bfloat16): its
    checkpoint holds float32 parameters and AdamW state."""
    out = tmp_path / "run"
    flags = ["--cp", "2", "--steps", "5", "--data", "_train_sources:nan_pixels", "--no-shuffle"]
    flags += ["--dtype", "bfloat16"]
    assert _run(out, *flags, "--skip-nonfinite", "1") == 0
    records = _metrics(out)
    assert [r["skipped_nonfinite"] for r in records] == [False, False, True, False, False]
    assert math.isnan(records[2]["loss"])
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 2)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_skipped_nonfinite"] == 1
    dcp_to_torch_save(out / "checkpoints" / "step_00000005", tmp_path / "saved.pt")
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)
    assert {t.dtype for t in saved["model"].values()} == {torch.float32}
    moments = [s["exp_avg_sq"] for s in saved["optim"]["state"].values()]
    assert moments and {t.dtype for t in moments} == {torch.float32}


def test_text_only_summary_shows_no_nan_and_tokens_over_time(tmp_path, capsys):
    """The summary of records as a text-only run writes them (the ranks print it; their output
    is not capturable here, so ``summarize`` runs in this process on the same records)."""
    from cpvlm.train import TrainConfig
    from cpvlm.train.metrics import MetricsLog, summarize

    config = TrainConfig().replace(parallel={"dp": 1}, data={"grad_accum": 1})
    log = MetricsLog(tmp_path)
    records = []
    for step, (tokens, seconds) in enumerate([(60, 3.0), (64, 0.5), (64, 0.5)], start=1):
        record = {"step": step, "loss": 5.0 - step, "tokens": tokens, "step_time_s": seconds}
        record.update(tokens_per_s=tokens / seconds, rows=1, rows_text_only=1, ranks=4)
        record.update(ranks_no_image=0, ranks_no_visual_tokens=0, mem_peak_mib=300.0)
        record.update(skipped_nonfinite=step == 2)
        log.write(record)
        records.append(record)
    summary = summarize(config, records, 0, log)
    printed = capsys.readouterr().out
    assert "nan" not in printed, printed
    assert "no step had images or videos (text-only data)" in printed
    assert "skipped         1 steps with a non-finite loss or gradient norm" in printed
    assert summary["tokens_per_s"] == 188 / 4.0  # not the mean of the per-step rates (84)
    assert summary["tokens_per_s_after_first"] == 128 / 1.0
