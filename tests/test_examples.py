"""examples/library_step.py (the README's "Using it" example) runs under torchrun on 4 CPU ranks
(gloo, the tiny Qwen3-VL, dp_shard 2 x cp 2, FSDP2) and prints the step's loss, which is the loss
of the whole global batch on one process. float32: the CP ranks sum the same terms in another
order, ~1e-7 relative; held to 1e-5 (docs/architecture.md, "Exactness").

The script runs as ``torchrun script`` would run it, in the session's 4-process torchrun world
(tests/conftest.py's ``torchrun_world``), after the Trainer runs of tests/hf/test_trainer.py
when they are collected too: its processes import transformers once for both.
"""

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from cpvlm.hf import SampleSpec, build_model, synthetic_batch  # noqa: E402
from cpvlm.verify import reference_loss_and_grads, rel_err  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "library_step.py"
# The example's microbatches: two per DP replica, seeds 100 * dp_rank + i.
SAMPLES = [SampleSpec(images=((4, 4), (8, 4)), text_len=20), SampleSpec(text_len=30)]
RANKS = 4
# The launch may be this module's own (a world of 4 processes importing transformers).
pytestmark = pytest.mark.timeout(900)


def torchrun_runs(run_dir) -> dict[str, tuple[int, dict]]:
    """The example for the session's torchrun worlds; what each rank prints goes to a file."""
    stdout = str(run_dir("library step") / "stdout")
    return {"library step": (RANKS, {"script": str(EXAMPLE), "argv": [], "stdout": stdout})}


def test_library_step_runs_on_4_ranks_and_prints_the_one_process_loss(torchrun_world):
    out = torchrun_world("library step")
    assert "terminate called" not in torchrun_world.stderr("library step")
    printed = [
        re.findall(r"^loss (\S+)$", (out / f"stdout.{rank}").read_text(), re.M)
        for rank in range(RANKS)
    ]
    assert len(printed[0]) == 1 and not any(printed[1:]), printed  # rank 0 only
    model = build_model("qwen3-vl-tiny")
    batches = [
        synthetic_batch(model.config, SAMPLES, seed=100 * d + i) for d in (0, 1) for i in (0, 1)
    ]
    ref_loss, _ = reference_loss_and_grads(model, documents=batches)
    assert rel_err(torch.tensor(float(printed[0][0])), ref_loss) <= 1e-5, (printed, ref_loss)
