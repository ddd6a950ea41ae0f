"""``cpvlm train`` at CP=1 and CP=2 from the same seed and data: the same losses, step by step.

Runs go through the command users run (``cpvlm train`` flags, local gloo processes). CP=1 is the
one-process run of the same model on the same packed rows; CP=2 splits every row over two ranks.
Tolerances: float64 1e-10 relative (the CP run sums the same terms in another order, ~1e-16 per
operation; observed <= 5e-16 over 3 steps); float32 1e-5 (unit round-off 6e-8, carried through
three AdamW steps; observed ~1e-7).
"""

import json

import pytest

from cpvlm.train.command import main as train_main
from cpvlm.train.metrics import _picks


def _train(out, *flags):
    assert train_main(["--out", str(out), *flags]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("dtype, tol", [("float64", 1e-10), ("float32", 1e-5)])
def test_cp1_and_cp2_losses_agree(tmp_path, dtype, tol):
    flags = ["--steps", "3", "--seq-len", "192", "--dtype", dtype]
    one = _train(tmp_path / "cp1", "--cp", "1", *flags)
    two = _train(tmp_path / "cp2", "--cp", "2", *flags)
    assert [r["tokens"] for r in one] == [r["tokens"] for r in two]  # the same rows
    assert all(r["ranks"] == 2 for r in two)
    assert all(r["attn_impl"] == "ring" for r in one + two)  # the explicit default, recorded
    for a, b in zip(one, two, strict=True):
        assert abs(a["loss"] - b["loss"]) <= tol * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
    assert two[-1]["loss"] < two[0]["loss"]
    if dtype == "float64":  # Ulysses attention on the balanced layout, through the same flags
        uly = _train(
            tmp_path / "ulysses", "--cp", "2", "--attn", "ulysses", "--layout", "balanced", *flags
        )
        for a, b in zip(one, uly, strict=True):
            assert abs(a["loss"] - b["loss"]) <= tol * abs(a["loss"]), (a["step"], b["loss"])
        assert all(r["attn_impl"] == "ulysses" for r in uly)
        auto = _train(tmp_path / "auto", "--cp", "2", "--attn", "auto", *flags)
        for a, b in zip(one, auto, strict=True):
            assert abs(a["loss"] - b["loss"]) <= tol * abs(a["loss"]), (a["step"], b["loss"])
        # What auto picked: recorded per step, counted in summary.json, printed at the end.
        picks = [r["attn_impl"] for r in auto]
        assert all(p in ("ring", "allgather", "ulysses") for p in picks), picks  # cp 2: no hybrid
        summary = json.loads((tmp_path / "auto" / "summary.json").read_text())
        assert summary["attn_impl_steps"] == {p: picks.count(p) for p in set(picks)}
        # The printed line comes from these counts (its wording: the test below); rank 0 prints it
        # from a launcher child whose stdout this test cannot capture reliably.


def test_text_only_rows_on_one_dp_rank_fsdp_equals_plain_sum(tmp_path):
    """DP rank 0 gets only text-only rows, DP rank 1 rows with images: FSDP2 (vision tower as its
    own unit) must not hang, and its losses equal those of the plain all-reduce sum (float64,
    1e-10: the two syncs add the same gradients in another order)."""
    flags = ["--cp", "2", "--dp", "2", "--steps", "2", "--seq-len", "128", "--dtype", "float64"]
    flags += ["--data", "_train_sources:text_rows_on_dp0", "--no-shuffle"]
    fsdp = _train(tmp_path / "fsdp", *flags)
    plain = _train(tmp_path / "none", *flags, "--data-parallel", "none")
    for a, b in zip(fsdp, plain, strict=True):
        assert a["rows_text_only"] == 1 and a["rows"] == 2
        assert abs(a["loss"] - b["loss"]) <= 1e-10 * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-10 * abs(a["grad_norm"])


def test_the_summary_names_autos_picks_most_frequent_first():
    steps = {"ulysses": 2, "hybrid 2x2": 1, "ring": 8}
    assert _picks(steps) == "picked ring in 8 steps, ulysses in 2 steps, hybrid 2x2 in 1 step"
