"""examples/library_step.py (the README's "Using it" example) runs under torchrun on 4 CPU ranks
(gloo, the tiny Qwen3-VL, dp_shard 2 x cp 2, FSDP2) and prints the step's loss, which is the loss
of the whole global batch on one process. float32: the CP ranks sum the same terms in another
order, ~1e-7 relative; held to 1e-5 (DESIGN section 6)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from cpvlm.integrations.hf import SampleSpec, build_model, synthetic_batch  # noqa: E402
from cpvlm.verify import reference_loss_and_grads, rel_err  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "library_step.py"
# The example's microbatches: two per DP replica, seeds 100 * dp_rank + i.
SAMPLES = [SampleSpec(images=((4, 4), (8, 4)), text_len=20), SampleSpec(text_len=30)]


def test_library_step_runs_on_4_ranks_and_prints_the_one_process_loss():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", str(EXAMPLE)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr, done.stderr[-3000:]
    printed = re.findall(r"^loss (\S+)$", done.stdout, re.M)
    assert len(printed) == 1, done.stdout  # rank 0 only
    model = build_model("qwen3-vl-tiny")
    batches = [
        synthetic_batch(model.config, SAMPLES, seed=100 * d + i) for d in (0, 1) for i in (0, 1)
    ]
    ref_loss, _ = reference_loss_and_grads(model, documents=batches)
    assert rel_err(torch.tensor(float(printed[0])), ref_loss) <= 1e-5, (printed, ref_loss)
