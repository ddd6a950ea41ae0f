"""``cpvlm train --ep``: expert parallelism under CP equals the run without it, step by step.

Through the command users run (local gloo processes), float64, the tiny MoE models with their
router load-balancing loss on. cp 2 x ep 2 (the CP pair is the EP group) against cp 1; dp 2 x
cp 2 x ep 4 (one EP group of all four ranks; each expert on one rank) and dp 2 x cp 2 x ep 2 (two
EP groups; each rank holds half of its two experts, FSDP2-sharded over the two ranks that hold
them) against dp 2 x cp 1; a checkpoint of the ep 4 run resumed at cp 2 x ep 2 (DCP reshards the
experts: two of the four experts per rank), and one of the dp 2 x cp 2 x ep 2 run (experts
FSDP2-sharded) resumed at ep 4, against the uninterrupted runs. Tolerance 1e-10 relative: the runs add the same
terms in another order (observed <= 2e-16 per step over three AdamW steps).
"""

import json
import shutil

import pytest

from cpvlm.hf import TINY_MODELS
from cpvlm.train.command import main as train_main

TOL = 1e-10
FLAGS = ["--dtype", "float64", "--steps", "3", "--no-shuffle", "--seq-len", "192"]
# Not in the slow lane: the three tests take about 20 s each (tiny models, three steps).


def _train(out, model, *flags):
    assert train_main(["--out", str(out), "--model", model, *FLAGS, *flags]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same(a, b, steps=(1, 2, 3)):
    assert [r["step"] for r in a] == list(steps) == [r["step"] for r in b]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]  # the same rows
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(ra[key] - rb[key]) <= TOL * abs(rb[key]), (ra["step"], key, ra, rb)


@pytest.mark.parametrize("model", ["qwen3-vl-moe-tiny", "qwen3.5-moe-tiny"])
def test_ep_under_cp_equals_the_run_without_it(tmp_path, model):
    assert TINY_MODELS[model]().get_text_config().output_router_logits  # the router loss is on
    one = _train(tmp_path / "cp1", model, "--cp", "1")
    _same(_train(tmp_path / "cp2_ep2", model, "--cp", "2", "--ep", "2"), one)
    dp = _train(tmp_path / "dp2_cp1", model, "--dp", "2", "--cp", "1")
    _same(_train(tmp_path / "dp2_cp2_ep4", model, "--dp", "2", "--cp", "2", "--ep", "4"), dp)
    _same(_train(tmp_path / "dp2_cp2_ep2", model, "--dp", "2", "--cp", "2", "--ep", "2"), dp)


@pytest.mark.parametrize(
    "saved, resumed",
    [
        # dp 1 x grad-accum 2 keeps the global batch of 2 rows per step
        (("--dp", "2", "--cp", "2", "--ep", "4"), ("--dp", "1", "--cp", "2", "--ep", "2")),
        # from experts FSDP2-sharded over their replicas to one expert per rank
        (("--dp", "2", "--cp", "2", "--ep", "2"), ("--dp", "2", "--cp", "2", "--ep", "4")),
    ],
    ids=["ep4_to_ep2", "fsdp_experts_ep2_to_ep4"],
)
def test_an_ep_checkpoint_resumes_at_another_ep_exactly(tmp_path, saved, resumed):
    model = "qwen3-vl-moe-tiny"
    full = tmp_path / "saved"
    before = _train(full, model, *saved, "--ckpt-every", "2")
    again = tmp_path / "resumed"
    shutil.copytree(full, again)
    shutil.rmtree(again / "checkpoints" / "step_00000003")
    after = _train(again, model, *resumed, "--resume")
    _same(after[2:], before[2:], steps=(3,))
