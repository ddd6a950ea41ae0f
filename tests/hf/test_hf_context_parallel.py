"""ContextParallelVLM on real gloo ranks against transformers' own one-process forward and backward.

The reference is the unwrapped model with its own sdpa attention on the whole batch, the loss
computed from its logits in the model's dtype (transformers' own loss upcasts to float32 only),
mean over valid labels. The CP side sums every rank's loss share and gradients (what the dp x cp
gradient sync does). float64: relative error <= 1e-10. The float64 models still round to float32
inside (RMSNorm, rotary angles; docs/hf_internals.md section 8), identically in both runs as long as
each value is computed from the same inputs, which holds in every mode but "replicate" (see below).
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("transformers")

from cpvlm.integrations.hf import (  # noqa: E402
    ContextParallelVLM,
    SampleSpec,
    build_model,
    prepare_batch,
    reference_loss_and_grads,
    synthetic_batch,
    vision_cost,
)
from cpvlm.testing import DistributedTestError, rel_err, run_distributed  # noqa: E402

MODELS = ["qwen3-vl-tiny", "qwen2.5-vl-tiny"]
# (attn, vision, flow): the scalable flow with both vision collectives, and the compat flow.
EXACT_CONFIGS = [
    ("ring", "route", "scalable"),
    ("allgather", "route", "scalable"),
    ("ring", "allgather", "compat"),
    ("allgather", "allgather", "compat"),
]

_models: dict = {}


def _model(name, dtype):
    """One model per (name, dtype) and process; callers deep-copy it."""
    if (name, dtype) not in _models:
        _models[name, dtype] = build_model(name, dtype=dtype, seed=0)
    return _models[name, dtype]


def _cp_step(rank, world_size, name, dtype, batch, configs, doc_lens=None):
    """Run every config on this rank; rank 0 returns the summed losses and gradients."""
    results = []
    for attn, vision, flow in configs:
        model = copy.deepcopy(_model(name, dtype))
        cp_model = ContextParallelVLM(model, dist.group.WORLD, attn=attn, vision=vision, flow=flow)
        out = cp_model(**batch, doc_lens=doc_lens)
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        grads = {}
        for n, p in model.named_parameters():
            g = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
            dist.all_reduce(g)
            grads[n] = g
        results.append(
            {
                "loss": loss,
                "grads": grads if rank == 0 else None,
                "visual_tokens": out.local_visual_tokens,
                "encoded_units": out.encoded_units,
            }
        )
    return results


def _assert_close(cp_result, ref_loss, ref_grads, tol):
    assert rel_err(cp_result["loss"], ref_loss) <= tol
    errors = {n: rel_err(cp_result["grads"][n], g) for n, g in ref_grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, (worst, errors[worst])
    # Every module group got a gradient (a dropped vision gradient would show up as zeros).
    for prefix in ("model.visual.patch_embed", "model.visual.blocks", "model.visual.merger"):
        assert any(
            n.startswith(prefix) and g.abs().sum() > 0 for n, g in cp_result["grads"].items()
        )


def _mixed_batch(model, dtype):
    """Images of different sizes, a video, and a text-only row; right padding."""
    samples = [
        SampleSpec(images=((4, 4), (8, 4)), videos=((2, 4, 4),), text_len=21),
        SampleSpec(text_len=30),
    ]
    return synthetic_batch(model.config, samples, dtype=dtype, seed=1)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_loss_and_every_gradient_match_transformers_float64(name, cp):
    model = _model(name, torch.float64)
    batch = _mixed_batch(model, torch.float64)
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    if name == "qwen3-vl-tiny":
        assert any(n.startswith("model.visual.deepstack_merger_list") for n in ref_grads)
    configs = [
        *EXACT_CONFIGS,
        ("allgather", "allgather", "scalable"),
        ("ring", "replicate", "scalable"),
    ]
    per_rank = run_distributed(_cp_step, cp, name, torch.float64, batch, configs)
    for i, config in enumerate(configs):
        # "replicate": every rank encodes every unit and back-propagates only its own rows, so the
        # tower's gradient is a sum of cp partial gradients, each rounded where the model casts to
        # float32 (vision rotary, RMSNorm); measured <= 8e-10, float32 round-off is 6e-8.
        tol = 1e-6 if config[1] == "replicate" else 1e-10
        _assert_close(per_rank[0][i], ref_loss, ref_grads, tol)


def _single_image_up_front(model, dtype):
    """One small image at the start of a long text: at cp=4 only rank 0 holds visual tokens and
    only one rank has a unit to encode."""
    return synthetic_batch(
        model.config, [SampleSpec(images=((4, 4),), text_len=60)], dtype=dtype, seed=2
    )


@pytest.mark.parametrize("name", MODELS)
def test_ranks_without_images_and_text_only_batches(name):
    model = _model(name, torch.float64)
    batch = _single_image_up_front(model, torch.float64)
    # Put the image first: its vision-start token is the first token.
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    per_rank = run_distributed(_cp_step, 4, name, torch.float64, batch, EXACT_CONFIGS[:2])
    for i in range(2):
        _assert_close(per_rank[0][i], ref_loss, ref_grads, 1e-10)
    assert [r[0]["encoded_units"] for r in per_rank].count(0) == 3
    assert [r[0]["visual_tokens"] for r in per_rank].count(0) >= 2

    text_only = synthetic_batch(
        model.config, [SampleSpec(text_len=23), SampleSpec(text_len=17)], dtype=torch.float64
    )
    text_only.pop("mm_token_type_ids")
    ref_loss, ref_grads = reference_loss_and_grads(model, text_only)
    per_rank = run_distributed(_cp_step, 3, name, torch.float64, text_only, EXACT_CONFIGS[:1])
    result = per_rank[0][0]
    assert rel_err(result["loss"], ref_loss) <= 1e-10
    for n, g in ref_grads.items():
        assert rel_err(result["grads"][n], g) <= 1e-10, n


def _packed(model, dtype):
    """Three documents packed in one row: image+video, a 3-token text document, two images."""
    docs = [
        SampleSpec(images=((4, 8),), videos=((2, 4, 4),), text_len=9),
        SampleSpec(text_len=3),
        SampleSpec(images=((4, 4), (4, 4)), text_len=12),
    ]
    parts = [
        synthetic_batch(model.config, [d], dtype=dtype, seed=10 + i) for i, d in enumerate(docs)
    ]
    packed = {}
    for key in parts[0]:
        if key == "attention_mask":
            continue
        dim = 1 if key in ("input_ids", "labels", "mm_token_type_ids") else 0
        present = [p[key] for p in parts if key in p]
        packed[key] = torch.cat(present, dim=dim)
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        present = [p[key] for p in parts if key in p]
        if present:
            packed[key] = torch.cat(present)
    if any("second_per_grid_ts" in p for p in parts):
        packed["second_per_grid_ts"] = torch.cat(
            [p["second_per_grid_ts"] for p in parts if "second_per_grid_ts" in p]
        )
    return packed, parts, [p["input_ids"].shape[1] for p in parts]


def _per_document_reference(model, parts):
    """transformers on each document alone, combined into one mean over all valid labels."""
    model.zero_grad(set_to_none=True)
    total, count = 0, 0
    for part in parts:
        inputs = {k: v for k, v in part.items() if k != "labels"}
        logits = model(**inputs, use_cache=False).logits[0, :-1]
        labels = part["labels"][0, 1:]
        total = total + F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
        model.model.rope_deltas = None
    loss = total / count
    loss.backward()
    grads = {
        n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_packed_documents_match_each_document_run_alone(name, cp):
    model = _model(name, torch.float64)
    packed, parts, doc_lens = _packed(model, torch.float64)
    ref_loss, ref_grads = _per_document_reference(model, parts)
    configs = [EXACT_CONFIGS[0], EXACT_CONFIGS[2]]
    per_rank = run_distributed(_cp_step, cp, name, torch.float64, packed, configs, doc_lens)
    for i in range(len(configs)):
        _assert_close(per_rank[0][i], ref_loss, ref_grads, 1e-10)


@pytest.mark.parametrize("name", MODELS)
def test_float32_within_1e_5(name):
    model = _model(name, torch.float32)
    batch = _mixed_batch(model, torch.float32)
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    per_rank = run_distributed(_cp_step, 2, name, torch.float32, batch, EXACT_CONFIGS)
    # float32: different summation orders (blockwise softmax, summed shares) give ~1e-7 relative
    # differences per value; 1e-5 leaves room for the accumulation over layers.
    for result in per_rank[0]:
        _assert_close(result, ref_loss, ref_grads, 1e-5)


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_bad_input_is_named(name):
    model = _model(name, torch.float64)
    good = _mixed_batch(model, torch.float64)
    grids = good["image_grid_thw"]
    cases = [
        (
            dict(image_grid_thw=grids[:1], pixel_values=good["pixel_values"][:16]),
            r"image tokens and features do not match: input_ids hold 12 image tokens .* gives 4 features",
        ),
        (
            dict(image_grid_thw=torch.tensor([[1, 4, 4], [1, 8, 3]])),
            r"image_grid_thw: grid_thw\[1\] = \[1, 8, 3\].*divisible by the merge size 2",
        ),
        (dict(mm_token_type_ids=None), "mm_token_type_ids is missing"),
        (
            dict(pixel_values=good["pixel_values"][:-1]),
            r"image pixel values have shape \(47, 384\).*48 patch rows",
        ),
        (dict(attention_mask=good["attention_mask"].flip(-1)), "must be right-padded"),
    ]
    for change, match in cases:
        batch = {**good, **change}
        if batch.get("mm_token_type_ids") is None:
            batch.pop("mm_token_type_ids")
        with pytest.raises(ValueError, match=match):
            prepare_batch(model, batch, 2)
    with pytest.raises(ValueError, match="doc_lens packs one row; got a batch of 2 rows"):
        prepare_batch(model, good, 2, doc_lens=[10, good["input_ids"].shape[1] - 10])
    packed, _, doc_lens = _packed(model, torch.float64)
    with pytest.raises(ValueError, match="straddles the boundary of packed document 0"):
        prepare_batch(model, packed, 2, doc_lens=[doc_lens[0] - 5, 5 + sum(doc_lens[1:])])


def _build(rank, world_size, name):
    return _model(name, torch.float64) is not None


def _cp_step_expect_error(rank, world_size, name, batch):
    model = copy.deepcopy(_model(name, torch.float64))
    ContextParallelVLM(model, dist.group.WORLD)(**batch)


def test_bad_input_raises_on_every_rank_before_any_collective():
    model = _model("qwen3-vl-tiny", torch.float64)
    batch = _mixed_batch(model, torch.float64)
    batch["image_grid_thw"] = batch["image_grid_thw"][:1]
    batch["pixel_values"] = batch["pixel_values"][:16]
    # Build the model everywhere first, so that every rank reaches the check within the
    # harness's grace period after the first failure.
    assert all(run_distributed(_build, 3, "qwen3-vl-tiny"))
    with pytest.raises(DistributedTestError, match=r"rank\(s\) \[0, 1, 2\] raised") as info:
        run_distributed(_cp_step_expect_error, 3, "qwen3-vl-tiny", batch)
    assert "image tokens and features do not match" in str(info.value)


def _local_pixels(rank, world_size, batch, cost):
    """This rank's share of the pixel rows, as a loader that decodes only its units gives it
    (units balanced by the tower's modelled cost, as ``ContextParallelVLM`` assigns them)."""
    from cpvlm.vision import assign_vision_units, vision_units

    grids = [batch[k] for k in ("image_grid_thw", "video_grid_thw") if k in batch]
    units = vision_units(torch.cat(grids), 2)
    mine = assign_vision_units(cost.unit_costs(units), world_size)[rank]
    pixels = torch.cat([batch[k] for k in ("pixel_values", "pixel_values_videos") if k in batch])
    rows = pixels[units.pixel_index(mine)]
    n_images = sum(units.pixel_counts[u] for u in mine if units.items[u] < len(grids[0]))
    local = {**batch, "pixel_values": rows[:n_images], "local_pixels": True}
    if "pixel_values_videos" in batch:
        local["pixel_values_videos"] = rows[n_images:]
    return local, len(mine)


def _cp_step_local(rank, world_size, name, dtype, batch, configs, cost):
    local, n_units = _local_pixels(rank, world_size, batch, cost)
    results = _cp_step(rank, world_size, name, dtype, local, configs)
    assert all(r["encoded_units"] == n_units for r in results)
    return results


def test_local_pixels_match_transformers_float64():
    """Each rank passes only the pixel rows of the units it encodes (images and video frames);
    loss and every gradient equal the one-process model's (float64, 1e-10) at cp 2, in the
    scalable flow (rows routed) and the compat flow (rows all-gathered). The single small image
    leaves one rank with no unit and an empty [0, C] pixel tensor."""
    name = "qwen3-vl-tiny"
    model = _model(name, torch.float64)
    configs = [("ring", "route", "scalable"), ("ring", "allgather", "compat")]
    for batch in (_mixed_batch(model, torch.float64), _single_image_up_front(model, torch.float64)):
        ref_loss, ref_grads = reference_loss_and_grads(model, batch)
        per_rank = run_distributed(
            _cp_step_local, 2, name, torch.float64, batch, configs, vision_cost(model)
        )
        for i in range(len(configs)):
            _assert_close(per_rank[0][i], ref_loss, ref_grads, 1e-10)
