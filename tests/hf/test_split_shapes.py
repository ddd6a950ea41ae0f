"""vision="split" against the unmodified transformers model for images whose per-patch tables do
not tile: non-square, sides that are multiples of neither the learned position table's side (8 in
the tiny Qwen3-VL, whose bilinear weights transformers computes in float32) nor Qwen2.5-VL's window
(2 x 2 merge groups), each image alone in its batch and so sharded over every rank, at cp 2, 3, 4.

The split tower takes every per-patch table (interpolation taps and weights, rotary positions,
window order) from transformers' own functions on the whole unit's grid and keeps the rows of its
patches, so the float32 steps inside them round identically in both runs. float64, no float64
islands on either side (build_model as is): the loss and every gradient at 1e-10; a table computed
another way (float32 ``linspace`` weights, for one) is off by ~1e-7 here.
"""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from cpvlm.encoders import vision_units  # noqa: E402
from cpvlm.hf import (  # noqa: E402  # noqa: E402
    ContextParallelVLM,
    SampleSpec,
    adapter_for,
    build_model,
    synthetic_batch,
)
from cpvlm.options import CPOptions  # noqa: E402
from cpvlm.testing import rel_err, run_distributed  # noqa: E402
from cpvlm.verify import reference_loss_and_grads  # noqa: E402

FAMILIES = ("qwen3-vl-tiny", "qwen2.5-vl-tiny")
SHAPES = ((12, 16), (10, 6), (14, 22))  # (h, w) in patches; merge size 2
VISION = "model.visual."

_models: dict = {}


def _model(name):
    if name not in _models:
        _models[name] = build_model(name, dtype=torch.float64, seed=0)
    return _models[name]


def _batch(model, hw):
    samples = [SampleSpec(images=(hw,), text_len=20)]
    return synthetic_batch(model.config, samples, dtype=torch.float64, seed=sum(hw))


def _split_rank(rank, world, name):
    base = _model(name)
    m = adapter_for(base).merge_size
    results = []
    for hw in SHAPES:
        model = copy.deepcopy(base)
        cp_model = ContextParallelVLM(
            model, dist.group.WORLD, options=CPOptions(attn="ring", vision="split")
        )
        batch = _batch(base, hw)
        out = cp_model(**batch)
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        grads = {}
        for n, p in model.named_parameters():
            g = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
            dist.all_reduce(g)
            grads[n] = g
        sa = cp_model.vision_dp.split_assignment(vision_units(batch["image_grid_thw"], m))
        results.append(
            {
                "loss": loss,
                "grads": grads if rank == 0 else None,
                "split": sa.split,
                "pieces": len(sa.pieces(rank)),
            }
        )
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", FAMILIES)
def test_split_matches_transformers_for_shapes_that_do_not_tile(name, world):
    per_rank = run_distributed(_split_rank, world, name, timeout=600)
    for i, hw in enumerate(SHAPES):
        ref_loss, ref_grads = reference_loss_and_grads(_model(name), _batch(_model(name), hw))
        result = per_rank[0][i]
        # The one image is sharded, one piece on every rank.
        assert result["split"] == (0,), hw
        assert [r[i]["pieces"] for r in per_rank] == [1] * world, hw
        assert rel_err(result["loss"], ref_loss) <= 1e-10, hw
        vision = [n for n in ref_grads if n.startswith(VISION)]
        assert len(vision) > 10
        for n, g in ref_grads.items():
            assert rel_err(result["grads"][n], g) <= 1e-10, (hw, n)
        for n in vision:
            assert ref_grads[n].abs().sum() > 0, (hw, n)  # every tower parameter took part
