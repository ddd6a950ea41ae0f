"""cpvlm.simulate: the simulated rank's bytes against a real CPU run, and ``cpvlm plan``'s errors.

The real run is measured by benchmarks/memory.py's live-tensor tracker on gloo ranks; the
simulation runs the same step on fake tensors in this process. Saved-for-backward bytes must be
equal (both count each storage once; a fake tensor has its real tensor's shape and dtype); the
peak within 5% (the issue's bound: MemTracker and the real tracker see the same ops, but the
real run's figure includes what the gloo collectives allocate and the fake group does not).
"""

from __future__ import annotations

from cpvlm.cli import main as cli
from cpvlm.integrations.hf import TINY_MODELS
from cpvlm.simulate.batch import SequenceSpec
from cpvlm.testing import run_distributed
from cpvlm.testing.memory_check import real_step, simulated_step

SPEC = SequenceSpec(512, images=((64, 64),), videos=((4, 64, 64),), docs=2)


def test_simulated_rank_matches_real_run():
    loss_chunk = None
    config = TINY_MODELS["qwen3-vl-tiny"]()
    cp = 2
    real = run_distributed(real_step, cp, config, SPEC, "ring", loss_chunk, timeout=600)
    for rank in range(cp):
        sim = simulated_step(config, SPEC, cp, rank, "ring", loss_chunk)
        assert sim["saved"] == real[rank]["saved"], (rank, sim, real[rank])
        assert abs(sim["peak"] - real[rank]["peak"]) <= 0.05 * real[rank]["peak"], (rank, sim, real)


def test_plan_rejects_unknown_model(capsys):
    assert (
        cli(
            [
                "plan",
                "--model",
                "no-such-model",
                "--seq-len",
                "1024",
                "--gpus",
                "8",
                "--gpu-mem",
                "80",
            ]
        )
        == 2
    )
    assert "not a known config" in capsys.readouterr().err


def test_plan_rejects_cp_not_dividing_gpus(capsys):
    args = ["plan", "--model", "qwen3-vl-tiny", "--seq-len", "1024", "--gpus", "8"]
    assert cli([*args, "--gpu-mem", "80", "--cp", "3"]) == 2
    assert "must divide --gpus 8" in capsys.readouterr().err
