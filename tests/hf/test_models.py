"""Tiny models of every family: builds, synthetic batches, the float64 reference step, and the
transformers 5.x behaviours the CP integration relies on (docs/hf_internals.md).

Tolerances: float64 runs that take a different but equivalent path (a boolean mask instead of
is_causal, another row order) agree to round-off, checked at 1e-12 relative; transformers' own
loss upcasts float64 logits to float32, so it is compared with the float64 reference at 1e-5.
"""

import contextlib
import inspect
import re
from dataclasses import replace

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hf_families import (
    AUDIO_CLIPS,
    DEEPSTACK,
    FAMILIES,
    FAMILY_OF,
    FRAME_TIMESTAMPS,
    GEMMA,
    GLM,
    LINEAR_ATTENTION,
    OWN_LAYOUT,
    TILED,
    UNUSED,
    cached_model,
    grad_errors,
    mixes,
    reset_text_attention,
)  # noqa: E402
from transformers import AttentionInterface, AttentionMaskInterface  # noqa: E402
from transformers.masking_utils import sdpa_mask  # noqa: E402

from cpvlm.hf import (  # noqa: E402
    IGNORE_INDEX,
    TINY_MODELS,
    SampleSpec,
    adapter_for,
    build_model,
    model_family,
    supported,
    synthetic_batch,
)
from cpvlm.hf.adapter import module_at  # noqa: E402
from cpvlm.verify import causal_lm_loss, mrope_position_ids, reference_loss_and_grads  # noqa: E402

# The Qwen-VL-layout families (grids of pixel rows in the model's own batch, M-RoPE): these
# tests check the transformers behaviours of that layout. Gemma takes images its own way and has
# 1D positions: tests/hf/test_gemma.py checks its model, batches and masks.
NAMES = [n for n in FAMILIES if n not in GEMMA]
# The decoder of these is a recurrence over the sequence (Qwen3.5's Gated DeltaNet layers): a
# reordered or packed row without CP is a different sequence to it, so the two tests of the
# attention-only decoders' behaviour below do not apply (tests/hf/test_qwen3_5.py).
# The Qwen-VL layout (pixel rows and grids straight into the model, M-RoPE): the tiling families
# (tests/hf/test_tiled_families.py) take [tiles, C, H, W] pixels and 1D positions.
# Nemotron Omni (own_layout): its own image tokens and grids, 1D positions, no videos.
QWEN_LAYOUT = [n for n in NAMES if n not in TILED | OWN_LAYOUT]
ATTENTION_ONLY = [n for n in QWEN_LAYOUT if n not in LINEAR_ATTENTION]
# Two images of different sizes, one video (2 temporal patch-frames), one text-only sample.
SAMPLES = [
    SampleSpec(images=((4, 6),), text_len=10),
    SampleSpec(images=((8, 4),), videos=((2, 4, 4),), text_len=7),
    SampleSpec(text_len=12),
]
ONE_SAMPLE = [SampleSpec(images=((4, 6),), videos=((2, 4, 4),), text_len=10)]


def samples(name, which, audio=False):
    """``which`` for ``name``; for a model whose own forward takes only one kind of vision input
    per call (GLM-4V), the video of a mixed sample becomes a second image; with ``audio``, a model
    with an audio encoder gets the kit's first audio clip in the first sample."""
    if audio and name in AUDIO_CLIPS:
        first = replace(which[0], audios=AUDIO_CLIPS[name][:1])
        which = [first, *which[1:]]
    if mixes(name):
        return which
    return [
        SampleSpec(s.images + ((4, 4),) * len(s.videos), (), s.text_len, s.audios) for s in which
    ]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls: threads only add contention (10x slower on a busy 2-core runner).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@contextlib.contextmanager
def registered(name, attention, mask=None):
    AttentionInterface.register(name, attention)
    if mask is not None:
        AttentionMaskInterface.register(name, mask)
    try:
        yield name
    finally:
        reset_text_attention()  # a failed test must not leave a cached model on this name
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)


def causal_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # q [B,Hq,S,D], k/v [B,Hkv,S,D] (GQA unexpanded); returns [B,S,Hq,D] and no weights.
    out = F.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def position_masked_sdpa(text_row):
    """sdpa under a causal mask over the global text positions ``text_row`` [B,S]: the attention
    no longer depends on the local token order. (Most families also pass row 0 of [4,B,S] position
    ids to the attention as ``position_ids``; GLM-4.5V passes its rotary rows instead.)"""

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if kwargs["position_ids"].dim() == 2:
            assert torch.equal(kwargs["position_ids"], text_row)
        return _position_masked(text_row, query, key, value, scaling)

    return attention


def _position_masked(pos, query, key, value, scaling):
    allowed = pos[:, None, :, None] >= pos[:, None, None, :]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def model_inputs(batch, model=None):
    """The model's own forward keywords (a tiling family: pixel rows as tiles)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return inputs if model is None else adapter_for(model).to_model_batch(inputs)


def embed_multimodal(model, batch):
    """inputs_embeds, visual_pos_masks, deepstack_visual_embeds as the model's forward builds
    them."""
    base, ids = model.model, batch["input_ids"]
    embeds = base.get_input_embeddings()(ids)
    types = adapter_for(model).mm_token_type_ids(ids)
    masks = {"image": types == 1, "video": types == 2}
    keys = {
        "image": ("pixel_values", "image_grid_thw"),
        "video": ("pixel_values_videos", "video_grid_thw"),
    }
    feats = {}
    for kind, (pix, grid) in keys.items():
        if pix in batch:
            feats[kind] = base.get_image_features(batch[pix], batch[grid])
            rows = torch.cat(feats[kind].pooler_output).to(embeds.dtype)
            embeds = embeds.masked_scatter(masks[kind][..., None], rows)
    if not hasattr(model.config.vision_config, "deepstack_visual_indexes"):
        return embeds, None, None
    visual = masks["image"] | masks["video"]
    deepstack = []
    for level in range(len(model.config.vision_config.deepstack_visual_indexes)):
        joint = embeds.new_zeros(embeds.shape)
        for kind, f in feats.items():
            joint[masks[kind]] = torch.cat(f.deepstack_features[level]).to(embeds.dtype)
        deepstack.append(joint[visual])
    return embeds, visual, deepstack


def language_model_hidden(model, embeds, position_ids, visual, deepstack):
    extra = {}
    if deepstack is not None:
        extra = {"visual_pos_masks": visual, "deepstack_visual_embeds": deepstack}
    out = model.model.language_model(
        inputs_embeds=embeds,
        position_ids=position_ids,
        attention_mask=None,
        use_cache=False,
        **extra,
    )
    return out.last_hidden_state


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_builds(name):
    model = cached_model(name)
    config = model.config
    assert model.training and model.dtype == torch.float64
    assert model_family(model) == adapter_for(config).family == FAMILY_OF[name]
    assert type(model).__name__ in supported()
    assert sum(p.numel() for p in model.parameters()) < 400_000
    assert config.text_config._attn_implementation == "sdpa"
    assert config.vision_config._attn_implementation == "sdpa"
    vocab = config.text_config.vocab_size
    specials = adapter_for(model).special_token_ids
    # image, (video,) and their markers; tiles: image and its markers only; own layout: no video
    least = 2 if name in TILED else 3 if name in OWN_LAYOUT else 4
    assert len(specials) >= least and max(specials) < vocab
    assert config.text_config.num_attention_heads == 2 * config.text_config.num_key_value_heads
    # Same seed, same weights in every dtype.
    model32 = cached_model(name, torch.float32)
    for (n, p64), (_, p32) in zip(model.named_parameters(), model32.named_parameters()):
        assert torch.equal(p64, p32.double()), n


def test_tiny_config_overrides():
    tiny_qwen3_vl_config = TINY_MODELS["qwen3-vl-tiny"]
    config = tiny_qwen3_vl_config(vision_config={"depth": 4})
    assert config.vision_config.depth == 4
    assert config.vision_config.deepstack_visual_indexes == [0, 3]
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        tiny_qwen3_vl_config(vision_config={"depth": 2, "deepstack_visual_indexes": [2]})
    config = TINY_MODELS["qwen2.5-vl-tiny"](
        vision_config={"depth": 3}, text_config={"num_hidden_layers": 1}
    )
    assert config.vision_config.fullatt_block_indexes == [2]
    assert config.text_config.num_hidden_layers == 1
    with pytest.raises(ValueError, match="model_type"):
        model_family(config.text_config)


def test_unsupported_model_gets_the_list_of_supported_ones():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cpvlm.hf import ContextParallelVLM

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    text_only = Qwen2ForCausalLM(config)
    for make in (adapter_for, ContextParallelVLM):
        with pytest.raises(ValueError, match=r"unsupported model class Qwen2ForCausalLM") as info:
            make(text_only)
        for family_class in (
            "Qwen2VLForConditionalGeneration",
            "Qwen2_5_VLForConditionalGeneration",
            "Qwen3VLForConditionalGeneration",
            "Qwen3VLMoeForConditionalGeneration",
            "Glm4vForConditionalGeneration",
            "Glm46VForConditionalGeneration",
            "Glm4vMoeForConditionalGeneration",
        ):
            assert family_class in str(info.value)
    with pytest.raises(ValueError, match=r"unsupported config model_type 'qwen2'"):
        adapter_for(config)


@pytest.mark.parametrize("name", QWEN_LAYOUT)
def test_synthetic_batch_layout(name):
    config = TINY_MODELS[name]()
    batch = synthetic_batch(config, SAMPLES, seed=1, pad_to_multiple_of=4)
    vision, merge = config.vision_config, config.vision_config.spatial_merge_size
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape[0] == 3 and ids.shape[1] % 4 == 0
    assert batch["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 4]]
    assert batch["video_grid_thw"].tolist() == [[2, 4, 4]]
    row = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    assert batch["pixel_values"].shape == (24 + 32, row)
    assert batch["pixel_values_videos"].shape == (32, row)
    types = batch["mm_token_type_ids"]
    if name in GLM:  # video frames are image tokens inside <|begin_of_video|> ... <|end_of_video|>
        assert (ids == config.image_token_id).sum() == (24 + 32 + 32) // merge**2
        video_span = (ids == config.video_start_token_id).cumsum(-1) > (
            ids == config.video_end_token_id
        ).cumsum(-1)
        expected_types = (ids == config.image_token_id).long() * (1 + video_span.long())
        # one <|begin_of_image|> group per image and per frame; one video group
        assert (ids == config.image_start_token_id).sum() == 2 + 2
        assert (ids == config.image_end_token_id).sum() == 2 + 2
        assert (ids == config.video_start_token_id).sum() == 1
        assert (ids == config.video_end_token_id).sum() == 1
    else:
        assert (ids == config.image_token_id).sum() == (24 + 32) // merge**2
        assert (ids == config.video_token_id).sum() == 32 // merge**2
        expected_types = (ids == config.image_token_id).long() + 2 * (ids == config.video_token_id)
        # Qwen3-VL and Qwen3.5: one start/end pair per frame
        frames = 2 if name in FRAME_TIMESTAMPS else 1
        assert (ids == config.vision_start_token_id).sum() == 2 + frames
        assert (ids == config.vision_end_token_id).sum() == 2 + frames
    assert torch.equal(types, expected_types)
    assert (types == 1).sum() == (24 + 32) // merge**2 and (types == 2).sum() == 32 // merge**2
    labels = batch["labels"]
    ignored = (types != 0) | (mask == 0)
    assert torch.equal(labels == IGNORE_INDEX, ignored)
    assert torch.equal(labels[~ignored], ids[~ignored])
    assert mask[2].sum() == 12 and not mask[2, 12:].any()  # the text-only sample, right-padded
    assert torch.equal(
        synthetic_batch(config, SAMPLES, seed=1)["pixel_values"], batch["pixel_values"]
    )


@pytest.mark.parametrize("name", NAMES)
def test_reference_loss_and_grads(name):
    model = cached_model(name)
    batch = synthetic_batch(model.config, samples(name, SAMPLES, audio=True), seed=1)
    loss, grads = reference_loss_and_grads(model, batch)
    assert loss.dtype == torch.float64
    assert all(p.grad is None for p in model.parameters())
    assert set(grads) == {n for n, p in model.named_parameters()}
    # Every part gets a gradient: vision blocks, mergers (deepstack too), embeddings, decoder, head.
    for n, g in grads.items():
        unused = name in UNUSED and re.match(UNUSED[name], n)
        assert torch.isfinite(g).all() and (g.abs().sum() > 0) != bool(unused), n

    # transformers' own loss (float32 cross-entropy; an MoE model adds its float32 router loss)
    # on the same model, and on the float32 model.
    hf = model(**adapter_for(model).to_model_batch(batch), use_cache=False)
    assert abs(hf.loss.item() - loss.item()) < 1e-5
    hf.loss.backward()
    hf_grads = {}
    for n, p in model.named_parameters():
        if p.grad is None:  # a parameter the forward never uses
            assert name in UNUSED and re.match(UNUSED[name], n), n
            continue
        hf_grads[n] = p.grad
    errors = grad_errors(name, hf_grads, {n: grads[n] for n in hf_grads})
    for n, err in errors.items():
        assert err < 1e-4, n
    model.zero_grad(set_to_none=True)
    model32 = cached_model(name, torch.float32)
    batch32 = synthetic_batch(model32.config, samples(name, SAMPLES, audio=True), seed=1)
    hf32 = model32(**adapter_for(model).to_model_batch(batch32), use_cache=False)
    assert abs(hf32.loss.item() - loss.item()) < 1e-5


def test_causal_lm_loss_without_valid_labels():
    logits = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    loss = causal_lm_loss(logits, torch.full((2, 5), IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.parametrize("name", QWEN_LAYOUT)
def test_mm_token_type_ids_is_required(name):
    model = cached_model(name)
    core = model_inputs(synthetic_batch(model.config, samples(name, ONE_SAMPLE), seed=1))
    batch = model_inputs(core, model)  # the forward's own keywords
    without = {k: v for k, v in batch.items() if k != "mm_token_type_ids"}
    # A get_rope_index without the keyword places items by input_ids alone (Qwen3-Omni's).
    get_rope_index = module_at(model, adapter_for(model).modules.rope_index)
    needs = "mm_token_type_ids" in inspect.signature(get_rope_index).parameters
    with torch.no_grad():
        if needs and name != "qwen2.5-vl-tiny":
            with pytest.raises(ValueError, match="mm_token_type_ids"):
                model(**without, use_cache=False)
        elif needs:  # Qwen2.5-VL silently falls back to 1-D positions.
            wrong = model(**without, use_cache=False).logits
            right = model(**batch, use_cache=False).logits
            assert not torch.allclose(wrong, right)
        explicit = model(**without, position_ids=mrope_position_ids(model, core), use_cache=False)
        assert torch.equal(explicit.logits, model(**batch, use_cache=False).logits)


@pytest.mark.parametrize("name", NAMES)
def test_custom_text_attention_matches_sdpa(name):
    model = cached_model(name)
    batch = model_inputs(synthetic_batch(model.config, samples(name, ONE_SAMPLE), seed=1), model)
    with torch.no_grad():
        expected = model(**batch, use_cache=False).logits
    calls = []

    def recording(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        calls.append((module, query.shape, key.shape, value.shape, attention_mask, scaling, kw))
        return causal_sdpa(module, query, key, value, attention_mask, scaling, dropout, **kw)

    with registered("cpvlm_test", recording):
        model.set_attn_implementation({"text_config": "cpvlm_test"})
        assert model.config.text_config._attn_implementation == "cpvlm_test"
        assert model.config.vision_config._attn_implementation == "sdpa"
        with torch.no_grad():
            logits = model(**batch, use_cache=False).logits
        model.set_attn_implementation({"text_config": "sdpa"})
    assert torch.equal(logits, expected)

    text = model.config.text_config
    seq, head_dim = batch["input_ids"].shape[1], 16
    # the vision tower never calls it; nor do Qwen3.5's linear-attention layers
    layers = text.num_hidden_layers
    if name in LINEAR_ATTENTION:
        layers = text.layer_types.count("full_attention")
    assert len(calls) == layers
    for module, q, k, v, attention_mask, scaling, kw in calls:
        assert q == (1, text.num_attention_heads, seq, head_dim)
        assert k == v == (1, text.num_key_value_heads, seq, head_dim)
        assert module.num_key_value_groups == 2 and module.is_causal
        assert attention_mask is None and scaling == head_dim**-0.5
        if name == "glm4v-moe-tiny":  # passes its [3,B,S] rotary positions on (CP ignores them)
            assert kw["position_ids"].shape == (3, 1, seq)
        elif name in TILED | OWN_LAYOUT:  # 1D: its [B,S] positions pass on (CP ignores them)
            assert torch.equal(kw["position_ids"], torch.arange(seq)[None])
        else:
            assert kw["position_ids"] is None  # only [4,B,S] position ids pass a text row


@pytest.mark.parametrize("name", NAMES)
def test_mask_registry_decides_the_mask_a_custom_attention_gets(name):
    model = cached_model(name)
    one = samples(name, ONE_SAMPLE)
    batch = model_inputs(synthetic_batch(model.config, one + [SampleSpec()], seed=1), model)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = model(**batch, use_cache=False).logits
    masks = []

    def recording(module, query, key, value, attention_mask, scaling=None, **kw):
        masks.append(attention_mask)
        return causal_sdpa(module, query, key, value, None, scaling)

    for mask_fn, expected_mask in [(None, None), (sdpa_mask, "bool"), (lambda **kw: None, None)]:
        masks.clear()
        with registered("cpvlm_test_mask", recording, mask_fn):
            model.set_attn_implementation({"text_config": "cpvlm_test_mask"})
            with torch.no_grad():
                logits = model(**batch, use_cache=False).logits
            model.set_attn_implementation({"text_config": "sdpa"})
        if expected_mask is None:  # padding mask dropped: fine for right padding under causality
            assert all(m is None for m in masks)
        else:
            seq = real.shape[1]
            assert masks[0].dtype == torch.bool and masks[0].shape == (2, 1, seq, seq)
        assert rel(logits[real], expected[real]) < 1e-12


@pytest.mark.parametrize("name", ATTENTION_ONLY)
def test_language_model_runs_on_reordered_local_tokens(name):
    """The decoder stack, given inputs_embeds, [4,B,S] positions, visual_pos_masks and deepstack
    rows in local order, is the model's; a head-tail reordering changes nothing but round-off."""
    model = cached_model(name)
    batch = model_inputs(synthetic_batch(model.config, samples(name, ONE_SAMPLE), seed=1))
    own = model_inputs(batch, model)  # the forward's own keywords
    with torch.no_grad():
        full = model.model(**own, use_cache=False).last_hidden_state
        logits = model(**own, use_cache=False).logits
        embeds, visual, deepstack = embed_multimodal(model, batch)
        mrope = mrope_position_ids(model, batch)
        assert torch.equal(language_model_hidden(model, embeds, mrope, visual, deepstack), full)
        assert torch.equal(model.lm_head(full), logits)
        keep = batch["attention_mask"].bool()
        if "logits_to_keep" in inspect.signature(type(model).forward).parameters:
            kept = model(**own, use_cache=False, logits_to_keep=keep).logits
            assert torch.equal(kept, logits[keep])  # (Qwen3-Omni's thinker takes no such keyword)

        seq = embeds.shape[1]
        chunks = torch.tensor_split(torch.arange(seq), 4)
        perm = torch.cat([chunks[0], chunks[3], chunks[1], chunks[2]])  # cp=2, ranks 0 then 1
        pos4 = torch.cat([perm.view(1, 1, -1), mrope[:, :, perm]])
        if deepstack is not None:
            order = (visual.long().cumsum(-1) - 1)[:, perm][visual[:, perm]]
            deepstack = [d[order] for d in deepstack]
            visual = visual[:, perm]
        with registered("cpvlm_test_pos", position_masked_sdpa(pos4[0])):
            model.set_attn_implementation({"text_config": "cpvlm_test_pos"})
            local = language_model_hidden(model, embeds[:, perm], pos4, visual, deepstack)
            model.set_attn_implementation({"text_config": "sdpa"})
        assert rel(local, full[:, perm]) < 1e-12
        # With sdpa, a text row that jumps is read as packed documents: a block mask, wrong here.
        wrong = language_model_hidden(model, embeds[:, perm], pos4, visual, deepstack)
        assert rel(wrong, full[:, perm]) > 1e-3


@pytest.mark.parametrize("name", ATTENTION_ONLY)
def test_packed_documents_with_per_document_positions(name):
    model = cached_model(name)
    second = {"videos": [(2, 4, 4)]} if mixes(name) else {"images": [(4, 4)]}
    docs = [
        model_inputs(synthetic_batch(model.config, images=[(4, 6)], text_len=9, seed=2)),
        model_inputs(synthetic_batch(model.config, **second, text_len=6, seed=3)),
    ]
    with torch.no_grad():
        alone = [model(**model_inputs(d, model), use_cache=False).logits for d in docs]
        lens = [d["input_ids"].shape[1] for d in docs]
        mrope = torch.cat([mrope_position_ids(model, d) for d in docs], dim=-1)
        text_row = torch.cat([torch.arange(n) for n in lens]).view(1, 1, -1)
        # One packed row: doc 0 holds an image, doc 1 the video (GLM: another image).
        vision = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
        packed = {
            k: torch.cat([d[k] for d in docs if k in d])
            for k in vision
            if k in docs[1] or k in docs[0]
        }
        packed["input_ids"] = torch.cat([d["input_ids"] for d in docs], dim=-1)
        pos4 = torch.cat([text_row, mrope])
        logits = model(**packed, position_ids=pos4, use_cache=False).logits
        assert rel(logits[:, : lens[0]], alone[0]) < 1e-12
        assert rel(logits[:, lens[0] :], alone[1]) < 1e-12
        # Documents leak into each other without the text row, with the default use_cache=True
        # (a cache turns packed detection off), or with any 2-D attention_mask.
        ones = torch.ones_like(packed["input_ids"])
        for leaky in (
            model(**packed, position_ids=mrope, use_cache=False).logits,
            model(**packed, position_ids=pos4).logits,
            model(**packed, position_ids=pos4, attention_mask=ones, use_cache=False).logits,
        ):
            assert rel(leaky[:, lens[0] :], alone[1]) > 1e-3


@pytest.mark.parametrize("name", QWEN_LAYOUT)
def test_vision_tower_encodes_images_and_frames_independently(name):
    """One tower call on every item equals one call per image and per video frame. GLM's tower
    takes frames only ((1, h, w) grids; get_video_features flattens videos), so its items are
    called as the model calls them: the adapter's ``encode``."""
    model = cached_model(name)
    batch = synthetic_batch(model.config, SAMPLES, seed=1, dtype=torch.float64)
    pixels = torch.cat([batch["pixel_values"], batch["pixel_values_videos"]])
    grids = torch.cat([batch["image_grid_thw"], batch["video_grid_thw"]])
    units = torch.tensor([[1, 4, 6], [1, 8, 4], [1, 4, 4], [1, 4, 4]])  # video split per frame
    assert units.prod(-1).sum() == pixels.shape[0]
    adapter = adapter_for(model)
    tower = adapter.vision_tower(model)

    def encode(rows, g):
        if name in GLM:
            return adapter.encode(model, rows, g)
        out = tower(rows, grid_thw=g)
        return (
            (out.pooler_output, out.deepstack_features) if name in DEEPSTACK else out.pooler_output
        )

    with torch.no_grad():
        together = encode(pixels, grids)
        parts = [
            encode(rows, g[None])
            for rows, g in zip(torch.split(pixels, units.prod(-1).tolist()), units)
        ]
    if name in DEEPSTACK:
        assert rel(torch.cat([p[0] for p in parts]), together[0]) < 1e-12
        for level, feat in enumerate(together[1]):
            assert rel(torch.cat([p[1][level] for p in parts]), feat) < 1e-12
    else:
        assert rel(torch.cat(parts), together) < 1e-12


@pytest.mark.parametrize("name", NAMES)
def test_local_checkpoint_round_trip(name, tmp_path):
    model = build_model(name)
    model.save_pretrained(tmp_path)
    loaded = build_model(tmp_path)
    assert type(loaded) is type(model) and loaded.training
    assert loaded.config.text_config._attn_implementation == "sdpa"
    expected, got = model.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    loaded64 = build_model(str(tmp_path), dtype=torch.float64)
    # one dtype (FSDP's), NemotronH's router too (transformers keeps it float32)
    assert {p.dtype for p in loaded64.parameters()} == {torch.float64}
    model64 = build_model(name, dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(loaded64.parameters(), model64.parameters()))
    with pytest.raises(FileNotFoundError, match="local checkpoint"):
        build_model(tmp_path / "missing")
