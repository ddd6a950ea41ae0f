"""transformers.Trainer and TRL's SFTTrainer under cpvlm's CP (cpvlm.integrations.hf.trainer, .trl),
through the examples a user copies, under torchrun on CPU (gloo), float64, tiny models.

Each configuration is one torchrun launch of an example, reused by every check on it. A run at
cp 2 (dp 1) and at dp 2 x cp 2 (gradient accumulation halved: the same global batch of 4 rows)
must log the same 3 losses in trainer_state.json and end with the same weights as the one-process
run (cp 1); the evaluation after training (a padded batch whose middle half, CP rank 1's share,
holds no label) must give the loss of the saved model's own forward (cpvlm.verify's reference).
Launches are the suite's time (each process imports transformers): the family-specific part (the
model's CP forward, positions, padded eval) runs at cp 2 for both families, the dp x cp
composition (data sharding, gradient sync; family-agnostic, in Trainer and accelerate) on
Qwen3-VL, under DDP and FSDP2, and with TRL's packing; TRL's LoRA (frozen base) at cp 2 with
gradient accumulation.
Tolerance 1e-10 relative (DESIGN section 6): the runs add the same float64 terms in other orders
(~1e-15 seen for the losses, ~1e-12 for weights after 3 Adam steps).
"""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", minversion="1.16")
pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from cpvlm import ShardPlan, shift_labels  # noqa: E402
from cpvlm.integrations.hf import build_model  # noqa: E402
from cpvlm.integrations.hf.trainer import check_trainer_args  # noqa: E402
from cpvlm.verify import reference_loss_and_grads, rel_err  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TOL = 1e-10
# The module's launches (torchrun of 1, 2 and 4 processes, each importing transformers) run in
# the first test that needs them: several minutes on 2 cores, beyond the suite's 300 s default.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """``launch(example, nproc, *args)`` -> the output dir of that run (each run once)."""
    done = {}

    def run(example: str, nproc: int, *args: str, out: Path | None = None) -> Path:
        key = (example, nproc, *args, out)
        if key not in done:
            out = out or tmp_path_factory.mktemp(example.split(".")[0])
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
            cmd += [str(EXAMPLES / example), "--output-dir", str(out), "--dtype", "float64", *args]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if (
                proc.returncode != 0
                and "terminate called without an active exception" in proc.stderr
            ):
                # Known, not yet fixed: once in CI a rank aborted at interpreter exit, after its
                # run had finished and saved (gloo's threads at shutdown). Run it once more,
                # afresh; a second failure fails the test.
                shutil.rmtree(out, ignore_errors=True)
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
            done[key] = out
        return done[key]

    return run


def _history(out: Path) -> list[dict]:
    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def _losses(out: Path, key: str = "loss") -> torch.Tensor:
    return torch.tensor([h[key] for h in _history(out) if key in h], dtype=torch.float64)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    (path,) = [p for p in out.glob("*.safetensors")]  # model.safetensors or the adapter's
    return load_file(path)


def _assert_same_run(out: Path, ref: Path) -> None:
    got, want = _losses(out), _losses(ref)
    assert len(want) == 3 and len(got) == 3, (got, want)
    assert rel_err(got, want) <= TOL, (got, want)
    w, w_ref = _weights(out), _weights(ref)
    assert w.keys() == w_ref.keys()
    worst = max(rel_err(w[k], w_ref[k]) for k in w_ref)
    assert worst <= TOL, worst


def _example_module():
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLES / "hf_trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", ["qwen3-vl-tiny", "qwen2.5-vl-tiny"])
def test_trainer_example_at_cp2_and_dp2_x_cp2_is_the_one_process_run(family, launch):
    common = ("--model", family, "--eval", "--save-steps", "2")
    ref = launch("hf_trainer.py", 1, "--cp", "1", "--grad-accum", "4", *common)
    # The eval after training: the loss of the saved model's own forward (from_pretrained).
    example = _example_module()
    model = build_model(str(ref), dtype=torch.float64)
    batch = example.collate(example.eval_samples(model.config, torch.float64))
    labels = shift_labels(batch["labels"])
    plan = ShardPlan(labels.shape[1], 2)
    padded = plan.pad(labels, seq_dim=1, value=-100)
    assert (batch["attention_mask"] == 0).any()  # the batch has padding
    assert (padded[:, plan.indices(1)] != -100).sum() == 0  # CP rank 1 holds no label
    want, _ = reference_loss_and_grads(model, batch)
    # dp 2 x cp 2 on the first family only (the dp x cp composition does not depend on it).
    configs = (
        ((1, 1, 4), (2, 2, 4), (4, 2, 2)) if family == "qwen3-vl-tiny" else ((1, 1, 4), (2, 2, 4))
    )
    for nproc, cp, accum in configs:
        out = launch("hf_trainer.py", nproc, "--cp", str(cp), "--grad-accum", str(accum), *common)
        (eval_loss,) = _losses(out, "eval_loss")
        assert rel_err(eval_loss, want) <= TOL, (nproc, cp, eval_loss, want)
        if nproc > 1:
            _assert_same_run(out, ref)


def test_trainer_example_under_fsdp2_at_dp2_x_cp2_is_the_one_process_run(launch):
    """accelerate's FSDP2 (fsdp_config version 2, full state dict) over the 4 ranks instead of
    DDP: the same losses, eval loss and saved weights as the cp 1 run (the first test's)."""
    common = ("--model", "qwen3-vl-tiny", "--eval")
    ref = launch("hf_trainer.py", 1, "--cp", "1", "--grad-accum", "4", *common, "--save-steps", "2")
    out = launch("hf_trainer.py", 4, "--cp", "2", "--grad-accum", "2", *common, "--fsdp")
    _assert_same_run(out, ref)
    assert rel_err(_losses(out, "eval_loss"), _losses(ref, "eval_loss")) <= TOL


def test_resume_from_checkpoint_continues_exactly(launch, tmp_path):
    """Step 3 resumed from checkpoint-2 (weights, optimizer, scheduler, data position) at cp 2
    ends where the uninterrupted run ends."""
    common = ("--model", "qwen3-vl-tiny", "--eval", "--save-steps", "2")
    whole = launch("hf_trainer.py", 2, "--cp", "2", "--grad-accum", "4", *common)
    shutil.copytree(whole / "checkpoint-2", tmp_path / "checkpoint-2")
    launch("hf_trainer.py", 2, "--cp", "2", "--grad-accum", "4", *common, "--resume", out=tmp_path)
    _assert_same_run(tmp_path, whole)


@pytest.mark.parametrize("lora", [(), ("--lora-r", "4")], ids=["full", "lora4"])
def test_trl_example_with_packing_at_cp2_and_dp2_x_cp2_is_the_one_process_run(lora, launch):
    common = ("--packing", "--batch-size", "2", *lora)
    ref = launch("trl_sft.py", 1, "--cp", "1", "--grad-accum", "2", *common)
    # One topology each (the packing, loss and gradient-sync path is the same for both): the
    # full model (every weight, the vision tower's too) at dp 2 x cp 2, LoRA (the frozen base
    # under DDP) at cp 2 with gradient accumulation.
    configs = ((4, 2, 1),) if not lora else ((2, 2, 2),)
    for nproc, cp, accum in configs:
        out = launch("trl_sft.py", nproc, "--cp", str(cp), "--grad-accum", str(accum), *common)
        _assert_same_run(out, ref)
    if lora:  # the adapter was written and trained (its B starts at zero)
        assert any("lora_B" in k and _weights(ref)[k].abs().sum() > 0 for k in _weights(ref))


def _args(tmp_path, **kwargs) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


def test_options_that_break_cp_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="world size 2 is not divisible by cp_size=3"):
        check_trainer_args(_args(tmp_path), 3, 2)
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        check_trainer_args(_args(tmp_path, label_smoothing_factor=0.1), 1, 1)
    with pytest.raises(ValueError, match="compute_loss_func"):
        check_trainer_args(_args(tmp_path), 1, 1, compute_loss_func=lambda *a, **k: 0)
    with pytest.raises(ValueError, match="checkpoints .save_strategy. under fsdp"):
        check_trainer_args(_args(tmp_path, fsdp=True, save_strategy="steps"), 1, 1)
    check_trainer_args(_args(tmp_path, fsdp=True, save_strategy="no"), 1, 1)
    args = _args(tmp_path)
    args.parallelism_config = type("ParallelismConfig", (), {"cp_size": 2})()
    with pytest.raises(ValueError, match="accelerate's own cp"):
        check_trainer_args(args, 2, 2)
