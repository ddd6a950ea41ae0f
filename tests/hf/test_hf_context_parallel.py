"""ContextParallelVLM on real gloo ranks against transformers' own one-process forward and backward,
for every family (tests/hf/hf_families.py).

The reference is the unwrapped model with its own sdpa attention on the whole batch (or on each
packed document alone), the loss computed from its logits in the model's dtype (transformers' own
loss upcasts to float32 only), mean over valid labels, plus an MoE model's router loss (the tiny
Qwen3-VL-MoE has it on). The CP side sums every rank's loss share and gradients (what the dp x cp
gradient sync does). float64: relative error <= 1e-10. The float64 models still round to float32
inside (RMSNorm, rotary angles; docs/hf_internals.md section 8), identically in both runs as long as
each value is computed from the same inputs, which holds in every mode but "replicate" (see below),
and except where a model computes a part in float32 whose sums CP groups differently: GLM-4V's
bicubic position table and GLM-4.5V's router run in float64 here (the same math in both runs,
tests/hf/hf_families.py), and the unchanged models are checked separately.
"""

import copy
import re

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_families import (  # noqa: E402
    FAMILIES,
    FAMILY_OF,
    FLOAT32_IN_FLOAT64,
    FLOAT32_TOL,
    GEMMA,
    cached_model,
    grad_errors,
    mixes,
)

from cpvlm import CPOptions, ShardPlan  # noqa: E402
from cpvlm.attention import Shapes, choose_impl  # noqa: E402
from cpvlm.hf import (  # noqa: E402
    ContextParallelVLM,
    SampleSpec,
    adapter_for,
    kit_for,
    prepare_batch,
    synthetic_batch,
    vision_cost,
)
from cpvlm.verify import (  # noqa: E402
    DistributedTestError,
    cp_loss_and_grads,
    mixed_batch,
    packed_documents,
    reference,
    rel_err,
    run_distributed,
)

# (attn, vision, flow[, more ContextParallelVLM keywords]): the scalable flow with both vision
# collectives, and the compat flow.
EXACT_CONFIGS = [
    ("ring", "route", "scalable"),
    ("allgather", "route", "scalable"),
    ("ring", "allgather", "compat"),
    ("allgather", "allgather", "compat"),
]
# Ulysses and hybrid (Ulysses over 2 ranks, a ring across: 2 x 1 at cp 2, 2 x 2 at cp 4); the
# tiny models have 4 query and 2 key/value heads, so at cp 4 Ulysses gives each rank one query
# head and sends each key/value head to two ranks. The first two families run them in every test,
# the others in the cp=4 ones (the adapter core passes them through alike).
HEAD_CONFIGS = [
    ("ulysses", "route", "scalable"),
    ("hybrid", "route", "scalable", {"ulysses_size": 2}),
    ("ulysses", "allgather", "compat"),
]
FIRST_FAMILIES = ("qwen3-vl-tiny", "qwen2.5-vl-tiny")
# vision="split" (the mixed batch's largest image is sharded at cp 2 and 4, tests/vision/
# test_vision_split.py checks that): every family whose adapter supports it, ring at cp 2; the
# first two families also all-gather K/V, and at cp 4.
SPLIT_CONFIGS = [("ring", "split", "scalable"), ("allgather", "split", "scalable")]
ALL_CONFIGS = [
    *EXACT_CONFIGS,
    ("allgather", "allgather", "scalable"),
    ("ring", "replicate", "scalable"),
]


def _single_image_up_front(model, dtype):
    """One small image at the start of a long text: at cp=4 only rank 0 holds visual tokens and
    only one rank has a unit to encode."""
    return synthetic_batch(
        model.config, [SampleSpec(images=((4, 4),), text_len=60)], dtype=dtype, seed=2
    )


def _text_only(model, dtype):
    batch = synthetic_batch(
        model.config, [SampleSpec(text_len=23), SampleSpec(text_len=17)], dtype=dtype
    )
    batch.pop("mm_token_type_ids")
    return batch


def _batch(model, dtype, kind):
    """``(batch, doc_lens)`` of one of the test batches, built the same way on every process."""
    if kind == "packed":
        packed, _, doc_lens = packed_documents(model, dtype)
        return packed, doc_lens
    make = {"mixed": mixed_batch, "single": _single_image_up_front, "text": _text_only}[kind]
    return make(model, dtype), None


def _model(name, dtype, islands=True):
    return cached_model(name, dtype, islands=islands)


def _cp_step(rank, world_size, name, dtype, kind, configs, islands=True):
    """Run every config on this rank; rank 0 returns the summed losses and gradients."""
    base = _model(name, dtype, islands)
    batch, doc_lens = _batch(base, dtype, kind)
    return _cp_configs(rank, base, batch, doc_lens, configs)


def _cp_configs(rank, base, batch, doc_lens, configs):
    results = []
    for attn, vision, flow, *more in configs:
        model = copy.deepcopy(base)
        options = CPOptions(attn=attn, vision=vision, flow=flow, **(more[0] if more else {}))
        cp_model = ContextParallelVLM(model, dist.group.WORLD, options=options)
        out, loss, grads = cp_loss_and_grads(cp_model, batch, doc_lens)
        results.append(
            {
                "loss": loss,
                "grads": grads if rank == 0 else None,
                "visual_tokens": out.local_visual_tokens,
                "encoded_units": out.encoded_units,
                "attn_impl": out.attn_impl,
            }
        )
    return results


def _reference(name, dtype, kind, islands=True):
    model = _model(name, dtype, islands)
    return reference(model, *_batch(model, dtype, kind))


def _assert_close(name, cp_result, ref_loss, ref_grads, tol, float32_pattern=None):
    loss_tol = FLOAT32_TOL if float32_pattern == "." else tol  # GLM-4.5V: routing weights too
    assert rel_err(cp_result["loss"], ref_loss) <= loss_tol
    kit = kit_for(cached_model(name).config)
    # Mathematically zero gradients (SigLIP's key bias) are round-off: measured against their
    # module group's largest reference gradient instead of themselves (grad_errors).
    for n, err in grad_errors(name, cp_result["grads"], ref_grads).items():
        limit = FLOAT32_TOL if float32_pattern and re.match(float32_pattern, n) else tol
        assert err <= limit, (n, err, limit)
    # Every vision module group got a gradient (a dropped vision gradient would show up as zeros).
    groups = [(label, pats) for label, pats in kit.module_groups() if label.startswith("vision")]
    assert len(groups) >= 3
    for label, patterns in groups:
        assert any(
            any(re.match(p, n) for p in patterns) and g.abs().sum() > 0
            for n, g in cp_result["grads"].items()
        ), label


def _run(name, cp, kind, configs, dtype=torch.float64, islands=True):
    ref_loss, ref_grads = _reference(name, dtype, kind, islands)
    per_rank = run_distributed(_cp_step, cp, name, dtype, kind, configs, islands)
    return ref_loss, ref_grads, per_rank


# cp 2 also under a second ATen kernel family (the README's test command, -m float64_family).
@pytest.mark.parametrize("cp", [pytest.param(2, marks=pytest.mark.float64_family), 4])
@pytest.mark.parametrize("name", FAMILIES)
def test_loss_and_every_gradient_match_transformers_float64(name, cp):
    # Every mode at cp=2; at cp=4 (for the families added after the first two, to keep the suite
    # short) both attentions with both vision collectives: the other two modes differ from these
    # only in which rows a rank keeps, not in how many ranks there are.
    configs = ALL_CONFIGS if cp == 2 or name in FIRST_FAMILIES else EXACT_CONFIGS
    if name in FIRST_FAMILIES:
        configs = [*configs, *HEAD_CONFIGS]
    elif cp == 4:
        configs = [*configs, *HEAD_CONFIGS[:2]]
    if name in GEMMA:  # the suite's time: both attentions and both vision collectives at cp 2,
        # the scalable flow's two attentions with Ulysses and hybrid at cp 4 (masks: test_gemma)
        configs = EXACT_CONFIGS if cp == 2 else [*EXACT_CONFIGS[:2], *HEAD_CONFIGS[:2]]
    if adapter_for(_model(name, torch.float64)).split_vision:
        split = SPLIT_CONFIGS if name in FIRST_FAMILIES else SPLIT_CONFIGS[:1] * (cp == 2)
        configs = [*configs, *split]  # a new list: configs may be ALL_CONFIGS itself
    ref_loss, ref_grads, per_rank = _run(name, cp, "mixed", configs)
    if name in ("qwen3-vl-tiny", "qwen3-vl-moe-tiny"):
        assert any(n.startswith("model.visual.deepstack_merger_list") for n in ref_grads)
    for i, config in enumerate(configs):
        # "replicate": every rank encodes every unit and back-propagates only its own rows, so the
        # tower's gradient is a sum of cp partial gradients, each rounded where the model casts to
        # float32 (vision rotary, RMSNorm); measured <= 8e-10, float32 round-off is 6e-8.
        tol = FLOAT32_TOL if config[1] == "replicate" else 1e-10
        _assert_close(name, per_rank[0][i], ref_loss, ref_grads, tol)


@pytest.mark.parametrize("name", sorted(FLOAT32_IN_FLOAT64))
def test_unchanged_glm_models_carry_only_float32_round_off(name):
    """The tests above run GLM's float32 islands in float64 (hf_families.py). The unchanged models
    differ from their one-process run only there: the loss and every other gradient at 1e-10, the
    parameters of FLOAT32_IN_FLOAT64 at float32 round-off."""
    ref_loss, ref_grads, per_rank = _run(name, 2, "mixed", EXACT_CONFIGS[:1], islands=False)
    pattern = FLOAT32_IN_FLOAT64[name]
    _assert_close(name, per_rank[0][0], ref_loss, ref_grads, 1e-10, float32_pattern=pattern)


@pytest.mark.parametrize("name", FAMILIES)
def test_ranks_without_images_and_text_only_batches(name):
    first = name in FIRST_FAMILIES
    configs = [*EXACT_CONFIGS[:2], *(HEAD_CONFIGS[:2] if first else ())]
    ref_loss, ref_grads, per_rank = _run(name, 4, "single", configs)
    for i in range(len(configs)):
        _assert_close(name, per_rank[0][i], ref_loss, ref_grads, 1e-10)
    assert [r[0]["encoded_units"] for r in per_rank].count(0) == 3
    assert [r[0]["visual_tokens"] for r in per_rank].count(0) >= 2

    configs = [EXACT_CONFIGS[0], *(HEAD_CONFIGS[:1] if first else ())]
    ref_loss, ref_grads, per_rank = _run(name, 3, "text", configs)
    for result in per_rank[0]:
        assert rel_err(result["loss"], ref_loss) <= 1e-10
        for n, err in grad_errors(name, result["grads"], ref_grads).items():
            assert err <= 1e-10, n


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", FAMILIES)
def test_packed_documents_match_each_document_run_alone(name, cp):
    # Both ShardPlan layouts: "balanced" places the short documents whole on one rank each.
    balanced = {"layout": "balanced"}
    hybrid = ("hybrid", "route", "scalable", {"ulysses_size": 2, **balanced})
    configs = [EXACT_CONFIGS[0], EXACT_CONFIGS[2]]
    if name in FIRST_FAMILIES:
        configs += [
            HEAD_CONFIGS[0],
            ("ring", "route", "scalable", balanced),
            ("ulysses", "allgather", "compat", balanced),
            hybrid,
            ("auto", "route", "scalable", balanced),
        ]
    elif cp == 4:
        configs.append(hybrid)
    ref_loss, ref_grads, per_rank = _run(name, cp, "packed", configs)
    for i in range(len(configs)):
        _assert_close(name, per_rank[0][i], ref_loss, ref_grads, 1e-10)
    reported = [r["attn_impl"] for r in per_rank[0]]
    assert all([r["attn_impl"] for r in ranks] == reported for ranks in per_rank)
    if name in FIRST_FAMILIES:
        # What ran is reported; auto: the cost model's pick for the text attention's shapes.
        model = _model(name, torch.float64)
        text = model.config.text_config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        heads = (text.num_attention_heads, text.num_key_value_heads)
        doc_lens = packed_documents(model, torch.float64)[2]
        plan = ShardPlan(sum(doc_lens), cp, doc_lens=doc_lens, layout="balanced")
        impl, u = choose_impl(plan, True, Shapes(1, *heads, head_dim, torch.float64))
        picked = impl if u is None else f"hybrid {u}x{cp // u}"
        hybrid_label = f"hybrid 2x{cp // 2}"
        assert reported == ["ring", "ring", "ulysses", "ring", "ulysses", hybrid_label, picked]


@pytest.mark.parametrize("name", FAMILIES)
def test_float32_within_1e_5(name):
    # both attentions and both vision collectives (all four pairs for the first two families)
    configs = (
        [*EXACT_CONFIGS, *HEAD_CONFIGS]
        if name in FIRST_FAMILIES
        else [EXACT_CONFIGS[0], EXACT_CONFIGS[3]]
    )
    ref_loss, ref_grads, per_rank = _run(name, 2, "mixed", configs, dtype=torch.float32)
    # float32: different summation orders (blockwise softmax, summed shares) give ~1e-7 relative
    # differences per value; 1e-5 leaves room for the accumulation over layers. Gemma 4's vision
    # tower (scores without a 1/sqrt(d) scale, q/k RMSNorm) amplifies them: measured 1.07e-5 on
    # its weights' gradients, and 1.2e-5 on its audio tower's first LayerNorm weight (a sum over
    # every frame and channel), which are exact to 1e-13 in float64; held to 3e-5.
    tol = 3e-5 if FAMILY_OF[name] == "gemma4" else 1e-5
    for result in per_rank[0]:
        _assert_close(name, result, ref_loss, ref_grads, tol)


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3-vl-tiny", "qwen2.5-vl-tiny"])
def test_bad_input_is_named(name):
    model = cached_model(name)
    good = mixed_batch(model, torch.float64)
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
    packed, _, doc_lens = packed_documents(model, torch.float64)
    with pytest.raises(ValueError, match="straddles the boundary of packed document 0"):
        prepare_batch(model, packed, 2, doc_lens=[doc_lens[0] - 5, 5 + sum(doc_lens[1:])])


def test_glm_video_frames_are_told_apart_by_token_type():
    """GLM-4V writes video frames with image tokens: token types marking them as images (1
    instead of 2) are rejected, naming the rule, and so are keys of another family."""
    model = cached_model("glm4v-tiny")
    _, parts, _ = packed_documents(model, torch.float64)
    video = parts[1]
    assert "video_grid_thw" in video and int((video["mm_token_type_ids"] == 2).sum()) == 8
    wrong = {**video, "mm_token_type_ids": video["mm_token_type_ids"].clamp(max=1)}
    with pytest.raises(ValueError, match="mm_token_type_ids does not match input_ids.*glm4v"):
        prepare_batch(model, wrong, 2)
    prep = prepare_batch(model, video, 2)
    assert prep.grid_thw.tolist() == [[2, 4, 4]] and int(prep.visual_mask.sum()) == 8


def _build(rank, world_size, name):
    return cached_model(name) is not None


def _cp_step_expect_error(rank, world_size, name, batch):
    model = copy.deepcopy(cached_model(name))
    ContextParallelVLM(model, dist.group.WORLD)(**batch)


def test_bad_input_raises_on_every_rank_before_any_collective():
    model = cached_model("qwen3-vl-tiny")
    batch = mixed_batch(model, torch.float64)
    batch["image_grid_thw"] = batch["image_grid_thw"][:1]
    batch["pixel_values"] = batch["pixel_values"][:16]
    # Build the model everywhere first, so that every rank reaches the check within the
    # harness's grace period after the first failure.
    assert all(run_distributed(_build, 3, "qwen3-vl-tiny"))
    with pytest.raises(DistributedTestError, match=r"rank\(s\) \[0, 1, 2\] raised") as info:
        run_distributed(_cp_step_expect_error, 3, "qwen3-vl-tiny", batch)
    assert "image tokens and features do not match" in str(info.value)
    second = {**mixed_batch(model, torch.float64), "second_per_grid_ts": torch.ones(1)}
    with pytest.raises(
        DistributedTestError, match=r"unexpected batch keys \['second_per_grid_ts'\]"
    ):
        run_distributed(_cp_step_expect_error, 3, "qwen3-vl-tiny", second)


def _local_pixels(rank, world_size, batch, merge, cost):
    """This rank's share of the pixel rows, as a loader that decodes only its units gives it
    (units balanced by the tower's modelled cost, as ``ContextParallelVLM`` assigns them)."""
    from cpvlm.encoders import assign_units, vision_units

    grids = [batch[k] for k in ("image_grid_thw", "video_grid_thw") if k in batch]
    units = vision_units(torch.cat(grids), merge)
    mine = assign_units(cost.unit_costs(units), world_size)[rank]
    pixels = torch.cat([batch[k] for k in ("pixel_values", "pixel_values_videos") if k in batch])
    rows = pixels[units.pixel_index(mine)]
    n_image_items = len(batch["image_grid_thw"]) if "image_grid_thw" in batch else 0
    n_images = sum(units.pixel_counts[u] for u in mine if units.items[u] < n_image_items)
    local = {**batch, "local_pixels": True}
    if "pixel_values" in batch:
        local["pixel_values"] = rows[:n_images]
    if "pixel_values_videos" in batch:
        local["pixel_values_videos"] = rows[n_images:]
    return local, len(mine)


def _cp_step_local(rank, world_size, name, dtype, kind, configs):
    base = _model(name, dtype)
    batch, doc_lens = _batch(base, dtype, kind)
    # The cost model from the model_type table, not through ContextParallelVLM's adapter.
    local, n_units = _local_pixels(
        rank, world_size, batch, base.config.vision_config.spatial_merge_size, vision_cost(base)
    )
    results = _cp_configs(rank, base, local, doc_lens, configs)
    assert all(r["encoded_units"] == n_units for r in results)
    return results


@pytest.mark.parametrize("name", ["qwen3-vl-tiny", "glm4v-tiny"])
def test_local_pixels_match_transformers_float64(name):
    """Each rank passes only the pixel rows of the units it encodes (images and video frames);
    loss and every gradient equal the one-process model's (float64, 1e-10) at cp 2, in the
    scalable flow (rows routed) and the compat flow (rows all-gathered). The single small image
    leaves one rank with no unit and an empty [0, C] pixel tensor. GLM-4V's forward cannot mix
    images and videos: its video frames come from the packed documents."""
    configs = [("ring", "route", "scalable"), ("ring", "allgather", "compat")]
    for kind in ("mixed" if mixes(name) else "packed", "single"):
        ref_loss, ref_grads = _reference(name, torch.float64, kind)
        per_rank = run_distributed(_cp_step_local, 2, name, torch.float64, kind, configs)
        for i in range(len(configs)):
            _assert_close(name, per_rank[0][i], ref_loss, ref_grads, 1e-10)
