"""transformers.Trainer and TRL's SFTTrainer under cpvlm's CP (cpvlm.hf.trainer, .trl),
through the examples a user copies, under torchrun on CPU (gloo), float64, tiny models.

Each configuration is one run of an example, reused by every check on it; the runs of one world
size share one torchrun launch (tests/hf/_torchrun_world.py runs the example scripts one after
another in the same processes; the 4-process world also runs tests/test_examples.py's library
step). A run at cp 2 (dp 1) and at dp 2 x cp 2 (gradient accumulation halved: the same global
batch of 4 rows) must log the same 3 losses in trainer_state.json and end with the same weights
as the one-process run (cp 1); the evaluation after training (a padded batch whose middle half,
CP rank 1's share, holds no label) must give the loss of the saved model's own forward
(cpvlm.verify's reference).
Launches are the suite's time (each process imports transformers): the family-specific part (the
model's CP forward, positions, padded eval) runs at cp 2 for both families, the dp x cp
composition (data sharding, gradient sync; family-agnostic, in Trainer and accelerate) on
Qwen3-VL, under DDP and FSDP2, and with TRL's packing; TRL's LoRA (frozen base) at cp 2 with
gradient accumulation; expert parallelism at cp 2 x ep 2 (tiny Qwen3-VL-MoE, router loss on) and
tensor parallelism at cp 2 x tp 2 (tiny Qwen3-VL, its q/k norms summed over TP), each against
its cp 1 run.
Tolerance 1e-10 relative (docs/architecture.md, "Exactness"): the runs add the same float64 terms in
other orders (~1e-15 seen for the losses, ~1e-12 for weights after 3 Adam steps).
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", minversion="1.16")
pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from cpvlm import ShardPlan, shift_labels  # noqa: E402
from cpvlm.hf import TINY_MODELS, build_model  # noqa: E402
from cpvlm.hf.trainer import check_model_parallel, check_trainer_args  # noqa: E402
from cpvlm.verify import reference_loss_and_grads, rel_err  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TOL = 1e-10
# The module's three launches (torchrun worlds of 1, 2 and 4 processes, each importing
# transformers) run in the first test that needs them: minutes on 2 cores, beyond the suite's
# 300 s default.
pytestmark = pytest.mark.timeout(900)

QWEN3 = ("--model", "qwen3-vl-tiny", "--eval", "--save-steps", "2")
QWEN25 = ("--model", "qwen2.5-vl-tiny", "--eval", "--save-steps", "2")
PACK, LORA = ("--packing", "--batch-size", "2"), ("--lora-r", "4")
MOE = ("--model", "qwen3-vl-moe-tiny", "--eval")
# name: (processes, example, flags). The runs of one world size share one launch (in this order,
# an FSDP run not first: tests/hf/_torchrun_world.py); "qwen3 resume" continues from a copy of
# "qwen3 cp2"'s checkpoint-2.
RUNS = {
    "qwen3 cp1": (1, "hf_trainer.py", ("--cp", "1", "--grad-accum", "4", *QWEN3)),
    "qwen2.5 cp1": (1, "hf_trainer.py", ("--cp", "1", "--grad-accum", "4", *QWEN25)),
    "trl cp1": (1, "trl_sft.py", ("--cp", "1", "--grad-accum", "2", *PACK)),
    "trl lora cp1": (1, "trl_sft.py", ("--cp", "1", "--grad-accum", "2", *PACK, *LORA)),
    "moe cp1": (1, "hf_trainer.py", ("--cp", "1", "--grad-accum", "4", *MOE)),
    "qwen3 cp2": (2, "hf_trainer.py", ("--cp", "2", "--grad-accum", "4", *QWEN3)),
    "qwen2.5 cp2": (2, "hf_trainer.py", ("--cp", "2", "--grad-accum", "4", *QWEN25)),
    "trl lora cp2": (2, "trl_sft.py", ("--cp", "2", "--grad-accum", "2", *PACK, *LORA)),
    "qwen3 resume": (2, "hf_trainer.py", ("--cp", "2", "--grad-accum", "4", *QWEN3, "--resume")),
    "qwen3 dp2 cp2": (4, "hf_trainer.py", ("--cp", "2", "--grad-accum", "2", *QWEN3)),
    "moe cp2 ep2": (2, "hf_trainer.py", ("--cp", "2", "--ep", "2", "--grad-accum", "4", *MOE)),
    "trl dp2 cp2": (4, "trl_sft.py", ("--cp", "2", "--grad-accum", "1", *PACK)),
    "qwen3 cp2 tp2": (
        4,
        "hf_trainer.py",
        ("--cp", "2", "--tp", "2", "--grad-accum", "4", "--model", "qwen3-vl-tiny", "--eval"),
    ),
    "qwen3 fsdp": (
        4,
        "hf_trainer.py",
        ("--cp", "2", "--grad-accum", "2", "--model", "qwen3-vl-tiny", "--eval", "--fsdp"),
    ),
}


def torchrun_runs(run_dir) -> dict[str, tuple[int, dict]]:
    """RUNS for the session's torchrun worlds (tests/conftest.py's ``torchrun_world``)."""
    runs = {}
    for name, (nproc, example, flags) in RUNS.items():
        argv = ["--output-dir", str(run_dir(name)), "--dtype", "float64", *flags]
        copy = []
        if name == "qwen3 resume":
            copy = [[str(run_dir(n) / "checkpoint-2") for n in ("qwen3 cp2", name)]]
        runs[name] = (nproc, {"script": str(EXAMPLES / example), "argv": argv, "copy": copy})
    return runs


@pytest.fixture(scope="module")
def run(torchrun_world):
    """``run(name)`` -> the output dir of that run of RUNS (its world launched once)."""
    return torchrun_world


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


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5"])
def test_trainer_example_at_cp2_and_dp2_x_cp2_is_the_one_process_run(family, run):
    ref = run(f"{family} cp1")
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
    names = ["cp1", "cp2", "dp2 cp2"] if family == "qwen3" else ["cp1", "cp2"]
    for name in names:
        out = run(f"{family} {name}")
        (eval_loss,) = _losses(out, "eval_loss")
        assert rel_err(eval_loss, want) <= TOL, (name, eval_loss, want)
        if name != "cp1":
            _assert_same_run(out, ref)


def test_trainer_example_under_fsdp2_at_dp2_x_cp2_is_the_one_process_run(run):
    """accelerate's FSDP2 (fsdp_config version 2, full state dict) over the 4 ranks instead of
    DDP: the same losses, eval loss and saved weights as the cp 1 run (the first test's)."""
    ref, out = run("qwen3 cp1"), run("qwen3 fsdp")
    _assert_same_run(out, ref)
    assert rel_err(_losses(out, "eval_loss"), _losses(ref, "eval_loss")) <= TOL


def test_resume_from_checkpoint_continues_exactly(run):
    """Step 3 resumed from checkpoint-2 (weights, optimizer, scheduler, data position) at cp 2
    ends where the uninterrupted run ends."""
    resumed, whole = run("qwen3 resume"), run("qwen3 cp2")
    _assert_same_run(resumed, whole)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora4"])
def test_trl_example_with_packing_at_cp2_and_dp2_x_cp2_is_the_one_process_run(lora, run):
    # One topology each (the packing, loss and gradient-sync path is the same for both): the
    # full model (every weight, the vision tower's too) at dp 2 x cp 2, LoRA (the frozen base
    # under DDP) at cp 2 with gradient accumulation.
    ref = run("trl lora cp1" if lora else "trl cp1")
    _assert_same_run(run("trl lora cp2" if lora else "trl dp2 cp2"), ref)
    if lora:  # the adapter was written and trained (its B starts at zero)
        assert any("lora_B" in k and _weights(ref)[k].abs().sum() > 0 for k in _weights(ref))


@pytest.mark.parametrize(
    "name, ref", [("moe cp2 ep2", "moe cp1"), ("qwen3 cp2 tp2", "qwen3 cp1")], ids=["ep", "tp"]
)
def test_expert_and_tensor_parallelism_under_cp_are_the_one_process_run(name, ref, run):
    """``ep=2`` / ``tp=2`` with cp 2 (no DDP: cpvlm sums the sharded gradients itself, and clips
    by the norm over every mesh): the losses, gradient norms, eval loss and saved (gathered)
    weights of the cp 1 run."""
    if name.startswith("moe"):  # the router loss is on, its statistics summed over CP
        assert TINY_MODELS["qwen3-vl-moe-tiny"]().get_text_config().output_router_logits
    out, ref = run(name), run(ref)
    _assert_same_run(out, ref)
    for key in ("grad_norm", "eval_loss"):
        got, want = _losses(out, key), _losses(ref, key)
        assert len(got) == len(want) > 0 and rel_err(got, want) <= TOL, (key, got, want)


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


def test_ep_and_tp_sizes_and_combinations_that_cannot_work_are_refused_by_name(tmp_path):
    args = _args(tmp_path, save_strategy="no")
    with pytest.raises(ValueError, match="ep must be a positive int"):
        check_trainer_args(args, 2, 2, ep=0)
    with pytest.raises(ValueError, match="ep=4 must divide dp_shard x cp = 1 x 2"):
        check_trainer_args(args, 2, 2, ep=4)
    with pytest.raises(ValueError, match="world size 2 is not divisible by cp_size=2 x tp=2"):
        check_trainer_args(args, 2, 2, tp=2)
    with pytest.raises(ValueError, match="tensor and expert parallelism do not combine"):
        check_trainer_args(args, 2, 8, ep=2, tp=2)
    with pytest.raises(ValueError, match="ep=2 with fsdp: .* drop fsdp"):
        check_trainer_args(_args(tmp_path, fsdp=True, save_strategy="no"), 2, 2, ep=2)
    with pytest.raises(ValueError, match="checkpoints .save_strategy. with tp=2"):
        check_trainer_args(_args(tmp_path, save_strategy="steps"), 2, 4, tp=2)
    check_trainer_args(args, 2, 8, ep=4)  # dp 4 x cp 2: EP groups of 4 of those 8 ranks
    import transformers

    with pytest.MonkeyPatch.context() as mp:  # a release without the hook cpvlm overrides
        mp.delattr(transformers.Trainer, "_clip_grad_norm")
        with pytest.raises(ValueError, match=r"ep=4 needs transformers.Trainer._clip_grad_norm"):
            check_trainer_args(args, 2, 8, ep=4)
        check_trainer_args(args, 2, 8)  # without ep / tp the Trainer's own clipping is right
    check_trainer_args(args, 2, 8, tp=2)  # dp 2 x cp 2 x tp 2

    dense, moe = build_model("qwen3-vl-tiny"), build_model("qwen3-vl-moe-tiny")
    with pytest.raises(ValueError, match="ep = 2: expert parallelism needs a MoE model"):
        check_model_parallel(dense, 2, 1)
    experts = moe.config.get_text_config().num_experts
    with pytest.raises(ValueError, match=f"must divide the model's {experts} experts"):
        check_model_parallel(moe, experts + 1, 1)
    with pytest.raises(ValueError, match="tensor parallelism of MoE layers is not supported"):
        check_model_parallel(moe, 1, 2)
    heads = dense.config.get_text_config().num_attention_heads
    with pytest.raises(ValueError, match=f"tp = {heads + 1} must divide the model's"):
        check_model_parallel(dense, 1, heads + 1)
    check_model_parallel(moe, 2, 1)
    check_model_parallel(dense, 1, 2)
    with pytest.raises(ValueError, match="does not combine with LoRA"):
        check_model_parallel(_example_module().lora(dense, 4), 1, 2)
