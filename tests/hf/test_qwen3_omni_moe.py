"""Qwen3-Omni-MoE's thinker (Qwen3-VL's tower with deepstack, an MoE decoder, an unused audio
tower) under CP.

The shared family tests (hf_families.FAMILIES) run qwen3-omni-moe-tiny at cp 2 and 4 (mixed,
packed, a rank without images, text-only) and ``cpvlm verify`` at cp 2; here: what is particular
to the thinker. Its M-RoPE positions through the adapter's ``rope_index_kwargs`` are the
thinker's own ``get_rope_index``'s; a video's temporal positions follow its seconds per patch,
non-integer ones too, and CP matches the one-process model on them; the processor's
``video_second_per_grid`` is the core's ``second_per_grid_ts``, both ways; audio inputs and
audio tokens are refused by name, on every CP rank.

Reference: the model's own one-process forward and backward, its router softmax in float64 in
both runs (the kit's ``float64_islands``). float64 tolerance 1e-10.
"""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_families import cached_model, grad_errors  # noqa: E402

from cpvlm import CPOptions  # noqa: E402
from cpvlm.families.qwen3_omni_moe import (  # noqa: E402
    AUDIO_TOKEN_ID,
    qwen3_omni_30b_a3b_config,
)
from cpvlm.families.qwen3_vl import qwen3_vl_vision_cost  # noqa: E402
from cpvlm.hf import (  # noqa: E402
    ContextParallelVLM,
    SampleSpec,
    adapter_for,
    prepare_batch,
    synthetic_batch,
)
from cpvlm.verify import (  # noqa: E402
    DistributedTestError,
    cp_loss_and_grads,
    mixed_batch,
    mrope_position_ids,
    reference,
    rel_err,
    run_distributed,
)

NAME = "qwen3-omni-moe-tiny"
TIMEOUT = 600  # s; seconds on an idle 2-core machine, minutes when it is shared


def _video_batch(model, seconds):
    """An image and a video in one row, a text-only row (right padding), the video's seconds
    per temporal patch given."""
    samples = [
        SampleSpec(images=((4, 4),), videos=((3, 4, 6),), text_len=9),
        SampleSpec(text_len=14),
    ]
    batch = synthetic_batch(model.config, samples, dtype=torch.float64, seed=3)
    batch["second_per_grid_ts"] = torch.tensor([seconds], dtype=torch.float64)
    return batch


def _own_positions(model, batch, attention_mask):
    """The thinker's own ``get_rope_index`` with its own keywords."""
    positions, _ = model.model.get_rope_index(
        batch["input_ids"],
        image_grid_thw=batch.get("image_grid_thw"),
        video_grid_thw=batch.get("video_grid_thw"),
        attention_mask=attention_mask,
        second_per_grids=batch.get("second_per_grid_ts"),
    )
    return positions


def test_positions_are_the_thinkers_own():
    """The core's call (through ``rope_index_kwargs``) gives the thinker's own positions, with
    the batch's attention mask and, for an unpadded row without one, an all-ones mask."""
    model = cached_model(NAME)
    batch = mixed_batch(model, torch.float64)
    assert batch.get("video_grid_thw") is not None  # the thinker takes images and videos
    ours = mrope_position_ids(model, batch)
    assert torch.equal(ours, _own_positions(model, batch, batch["attention_mask"]))
    real = int(batch["attention_mask"][0].sum())  # row 0: the images and the video, unpadded
    row = {k: batch[k][:1, :real] for k in ("input_ids", "mm_token_type_ids")}
    row.update({k: batch[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")})
    ones = torch.ones_like(row["input_ids"])
    assert torch.equal(mrope_position_ids(model, row), _own_positions(model, row, ones))


def test_video_positions_follow_the_seconds():
    """A video's temporal positions step by seconds x ``position_id_per_seconds`` (no timestamp
    tokens between frames): 0.3 s per patch at 25 per second is 7.5 per frame."""
    model = cached_model(NAME)
    batch = _video_batch(model, 0.3)
    positions = mrope_position_ids(model, batch)
    video = batch["input_ids"][0] == model.config.video_token_id
    t = positions[0, 0, video].unique()
    step = 0.3 * model.config.position_id_per_seconds
    assert len(t) == 3 and torch.allclose(t - t[0], torch.arange(3.0) * step)
    vs = model.config.vision_start_token_id
    assert int((batch["input_ids"][0] == vs).sum()) == 2  # one group per image and per video


def test_videos_need_their_seconds():
    model = cached_model(NAME)
    batch = _video_batch(model, 1.0)
    del batch["second_per_grid_ts"]
    with pytest.raises(ValueError, match="needs second_per_grid_ts"):
        prepare_batch(model, batch, 2)


def _cp(rank, world_size, cases):
    base = cached_model(NAME)
    results = []
    for seconds, attn in cases:
        batch = _video_batch(base, seconds)
        model = copy.deepcopy(base)
        cp_model = ContextParallelVLM(model, dist.group.WORLD, options=CPOptions(attn=attn))
        _, loss, grads = cp_loss_and_grads(cp_model, batch, None)
        results.append({"loss": loss, "grads": grads if rank == 0 else None})
    return results


def test_cp_matches_one_process_on_fractional_video_positions():
    """Non-integer temporal positions (float, as the thinker's own) through CP at cp 2."""
    cases = [(0.3, "ring"), (0.3, "allgather")]
    model = cached_model(NAME)
    ref_loss, ref_grads = reference(model, _video_batch(model, 0.3), None)
    per_rank = run_distributed(_cp, 2, cases, timeout=TIMEOUT)
    for i, case in enumerate(cases):
        result = per_rank[0][i]
        errs = grad_errors(NAME, result["grads"], ref_grads)
        worst = max(errs, key=errs.get)
        loss_err = rel_err(result["loss"], ref_loss)
        print(f"cp=2 {case}: loss {loss_err:.1e}, worst {worst} {errs[worst]:.1e}")
        assert loss_err <= 1e-10 and errs[worst] <= 1e-10, (case, worst, errs[worst])


def test_the_models_own_batch():
    """The processor's ``video_second_per_grid`` is the core's ``second_per_grid_ts`` and back;
    the forward gets no token types and an attention mask."""
    model = cached_model(NAME)
    adapter = adapter_for(model)
    batch = _video_batch(model, 0.5)
    own = adapter.to_model_batch({k: v for k, v in batch.items() if k != "attention_mask"})
    assert "mm_token_type_ids" not in own and "second_per_grid_ts" not in own
    assert torch.equal(own["video_second_per_grid"], batch["second_per_grid_ts"])
    assert torch.equal(own["attention_mask"], torch.ones_like(batch["input_ids"]))
    core = adapter.from_model_batch(own)
    assert "video_second_per_grid" not in core
    assert torch.equal(core["second_per_grid_ts"], batch["second_per_grid_ts"])


def test_audio_inputs_and_tokens_are_refused_by_name():
    model = cached_model(NAME)
    adapter = adapter_for(model)
    batch = mixed_batch(model, torch.float64)
    audio = {**batch, "input_features": torch.zeros(1, 16, 100)}
    with pytest.raises(ValueError, match=r"audio inputs \(input_features\) are not supported yet"):
        prepare_batch(model, audio, 2)
    with pytest.raises(ValueError, match="audio inputs"):
        adapter.to_model_batch(audio)
    ids = batch["input_ids"].clone()
    ids[1, 2] = AUDIO_TOKEN_ID
    with pytest.raises(ValueError, match="audio tokens"):
        prepare_batch(model, {**batch, "input_ids": ids}, 2)
    assert AUDIO_TOKEN_ID in adapter.special_token_ids  # never drawn as text


def _cp_audio_step(rank, world_size, batch):
    model = copy.deepcopy(cached_model(NAME))
    ContextParallelVLM(model, dist.group.WORLD)(**batch)


def test_audio_inputs_raise_on_every_cp_rank():
    """The CP step takes the audio keys (the model's own) only to refuse them, on every rank."""
    batch = mixed_batch(cached_model(NAME), torch.float64)
    batch["input_features"] = torch.zeros(1, 16, 100, dtype=torch.float64)
    with pytest.raises(DistributedTestError, match=r"rank\(s\) \[0, 1\] raised") as info:
        run_distributed(_cp_audio_step, 2, batch, timeout=TIMEOUT)
    assert "audio inputs (input_features) are not supported yet" in str(info.value)


def test_tower_cost_and_published_config():
    """Qwen3-VL's tower cost (the same tower); the published thinker builds with its
    dimensions and deepstack levels."""
    model = cached_model(NAME)
    adapter = adapter_for(model)
    assert adapter.vision_cost() == qwen3_vl_vision_cost(model.config.vision_config)
    config = qwen3_omni_30b_a3b_config()
    text, vision = config.text_config, config.vision_config
    assert (text.num_hidden_layers, text.hidden_size, text.num_experts) == (48, 2048, 128)
    assert list(vision.deepstack_visual_indexes) == [8, 16, 24]
    assert vision.out_hidden_size == text.hidden_size
    assert adapter_for(config).family == "qwen3_omni_moe"
