"""Qwen3-Omni-MoE's thinker (Qwen3-VL's tower with deepstack, an MoE decoder, an audio tower)
under CP.

The shared family tests (hf_families.FAMILIES) run qwen3-omni-moe-tiny at cp 2 and 4 (mixed,
packed, a rank without images, text-only) and ``cpvlm verify`` at cp 2; here: what is particular
to the thinker. Its M-RoPE positions through the adapter's ``rope_index_kwargs`` are the
thinker's own ``get_rope_index``'s; a video's temporal positions follow its seconds per patch,
non-integer ones too, and CP matches the one-process model on them; the processor's
``video_second_per_grid`` is the core's ``second_per_grid_ts``, both ways; the processor's audio
is the core's, both ways; a short clip's rows are those of the model's call on the whole batch
(its chunk padding); each clip is encoded on exactly one rank, and a clip encoded on a rank that
owns none of its positions gives exact gradients.

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
    packed_documents,
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
        audio_seqlens=batch.get("audio_lengths"),
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
    keys = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "audio_lengths")
    row.update({k: batch[k] for k in keys})
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


def test_the_processors_audio_is_the_cores():
    """The processor's padded ``input_features`` [clips, F, T] with ``feature_attention_mask``
    are the core's ``audio_features`` (valid frames, clip after clip) and ``audio_lengths``, and
    back; the token types mark the audio placeholders 3."""
    model = cached_model(NAME)
    adapter = adapter_for(model)
    batch = synthetic_batch(model.config, audios=(130, 57), text_len=6, seed=2)
    own = adapter.to_model_batch(batch)
    assert own["input_features"].shape == (2, 16, 130)
    assert own["feature_attention_mask"].sum(1).tolist() == [130, 57]
    assert not own["input_features"][1, :, 57:].any()
    assert torch.equal(own["input_features"][1, :, :57], batch["audio_features"][130:].T)
    core = adapter.from_model_batch({k: v for k, v in own.items() if k != "attention_mask"})
    assert torch.equal(core["audio_features"], batch["audio_features"])
    assert core["audio_lengths"].tolist() == [130, 57]
    rows = adapter.audio_rows(130) + adapter.audio_rows(57)
    assert int((core["mm_token_type_ids"] == 3).sum()) == rows == 17 + 8
    bad = {**batch, "audio_lengths": torch.tensor([130, 50])}
    with pytest.raises(ValueError, match="audio_features has shape"):
        prepare_batch(model, bad, 2)


def test_a_short_clip_is_padded_as_in_its_batch():
    """The tower pads every chunk to the longest of its call, and its convolution biases carry
    the padding into a shorter chunk's last rows: a short clip alone (padded to itself) is not
    what the model computes for it in a batch with a longer clip (the bias gradients show it);
    ``encode_audio`` with the batch's lengths is."""
    model = cached_model(NAME)
    adapter = adapter_for(model)
    batch = synthetic_batch(model.config, audios=(130, 57), text_len=6, dtype=torch.float64)
    own = adapter.to_model_batch(batch)
    bias = model.model.audio_tower.conv2d2.bias
    weights = torch.randn(8, model.config.text_config.hidden_size, dtype=torch.float64)

    def bias_grad(rows):
        return torch.autograd.grad((rows * weights).sum(), bias)[0]

    whole = model.model.get_audio_features(own["input_features"], own["feature_attention_mask"])
    expected = bias_grad(whole.last_hidden_state[17:])
    short, lengths = batch["audio_features"][130:], torch.tensor([57])
    in_batch = adapter.encode_audio(model, short, lengths, (130, 57))
    alone = adapter.encode_audio(model, short, lengths, (57,))
    assert rel_err(in_batch, whole.last_hidden_state[17:]) <= 1e-13  # other matmul shapes
    assert rel_err(bias_grad(in_batch), expected) <= 1e-12
    assert rel_err(bias_grad(alone), expected) > 1e-3


def _cp_audio(rank, world_size, batch, doc_lens, vision):
    model = copy.deepcopy(cached_model(NAME))
    calls = []
    tower = model.model.audio_tower
    tower.register_forward_hook(
        lambda m, args, kwargs, out: calls.append(int(kwargs["feature_lens"].numel())),
        with_kwargs=True,
    )
    options = CPOptions(vision=vision)
    cp_model = ContextParallelVLM(model, dist.group.WORLD, options=options)
    out, loss, grads = cp_loss_and_grads(cp_model, batch, doc_lens)
    owned = int(out.local_labels)
    return {
        "loss": loss,
        "grads": grads if rank == 0 else None,
        "encoded": out.encoded_audio,
        "calls": calls,
        "owned": owned,
    }


def _one_clip_in_the_middle(model):
    """One row: text, one audio clip in the middle of the row, text: at cp 2 the clip's
    positions are rank 1's (head-tail: rank 0 holds the first and last quarters), and the only
    clip is encoded by rank 0 (the balancer's first rank: no vision work to balance around)."""
    return synthetic_batch(
        model.config,
        [SampleSpec(text_len=48, audios=(57,))],
        dtype=torch.float64,
        seed=5,
    )


@pytest.mark.parametrize("vision", ["route", "allgather"])
def test_each_clip_is_encoded_once_and_exact(vision):
    """cp 2: the only clip is encoded by rank 0 (the tower's one real call there; rank 1 encodes
    a dummy clip), its rows are rank 1's positions, and loss and every gradient equal the
    one-process model's; cp 3 on the verify batches (two clips, a rank with neither audio nor
    image in the mixed batch), each clip encoded on exactly one rank."""
    model = cached_model(NAME)
    batch = _one_clip_in_the_middle(model)
    ids = batch["input_ids"][0]
    audio_at = torch.nonzero(ids == AUDIO_TOKEN_ID).squeeze(1)
    quarter = ids.numel() / 4
    assert bool(((audio_at >= quarter) & (audio_at < 3 * quarter)).all())  # rank 1's half
    ref_loss, ref_grads = reference(model, batch, None)
    per_rank = run_distributed(_cp_audio, 2, batch, None, vision, timeout=TIMEOUT)
    assert [r["encoded"] for r in per_rank] == [1, 0]
    assert per_rank[0]["calls"] == [1] and per_rank[1]["calls"] == [1]  # one tower call each
    errs = grad_errors(NAME, per_rank[0]["grads"], ref_grads)
    worst = max(errs, key=errs.get)
    assert rel_err(per_rank[0]["loss"], ref_loss) <= 1e-10 and errs[worst] <= 1e-10, worst
    assert errs["model.audio_tower.conv2d1.weight"] <= 1e-10

    packed, parts, doc_lens = packed_documents(model, torch.float64)
    ref_loss, ref_grads = reference(model, packed, doc_lens)
    per_rank = run_distributed(_cp_audio, 3, packed, doc_lens, vision, timeout=TIMEOUT)
    assert sum(r["encoded"] for r in per_rank) == len(packed["audio_lengths"]) == 2
    assert max(r["encoded"] for r in per_rank) == 1  # the two clips on two ranks
    errs = grad_errors(NAME, per_rank[0]["grads"], ref_grads)
    worst = max(errs, key=errs.get)
    assert rel_err(per_rank[0]["loss"], ref_loss) <= 1e-10 and errs[worst] <= 1e-10, worst


def _cp_counts(rank, world_size, batch):
    model = copy.deepcopy(cached_model(NAME))
    out = ContextParallelVLM(model, dist.group.WORLD)(**batch)
    return out.encoded_units, out.encoded_audio


def test_clips_balance_around_the_vision_work():
    """cp 2, one image and one clip: the image goes to rank 0, so the clip goes to rank 1 (the
    audio units balance around the vision units' modelled cost per rank)."""
    model = cached_model(NAME)
    batch = synthetic_batch(
        model.config, [SampleSpec(images=((8, 8),), text_len=20, audios=(57,))], seed=4
    )
    assert run_distributed(_cp_counts, 2, batch, timeout=TIMEOUT) == [(1, 0), (0, 1)]


def _cp_wrong_clip(rank, world_size, batch):
    if rank == 1:  # this rank alone was handed other clip lengths (same frames in all)
        batch = {**batch, "audio_lengths": batch["audio_lengths"].flip(0)}
    model = copy.deepcopy(cached_model(NAME))
    ContextParallelVLM(model, dist.group.WORLD)(**batch)


def test_audio_wrong_on_one_rank_raises_on_every_rank():
    model = cached_model(NAME)
    batch = synthetic_batch(model.config, audios=(130, 130), text_len=6, dtype=torch.float64)
    batch["audio_lengths"] = torch.tensor([200, 60])  # the same frames, cut elsewhere
    with pytest.raises(DistributedTestError, match=r"rank\(s\) \[0, 1\] raised"):
        run_distributed(_cp_wrong_clip, 2, batch, timeout=TIMEOUT)


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
