"""Gemma 3 and Gemma 4: their tiny models, their own batch layout, and the masks that matter.

The shared family tests (hf_families.FAMILIES) hold both to the model's own forward and backward
at 1e-10 in float64. Here: the tiny models have what those tests must see (sliding and full
layers, a window shorter than an image and than the rows, GQA, a projector that passes gradients
to the tower); the spans the core derives equal transformers' own image blocks; and each part of
the mask is needed: the CP loss with the window dropped, or the image spans dropped, or (Gemma 4)
the spans put on every layer, misses the model's loss by far more than the 1e-10 of the real
mask, so the exactness tests would catch a bridge that got any of them wrong.
"""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_families import GEMMA, cached_model  # noqa: E402

from cpvlm.integrations.hf import (  # noqa: E402
    ContextParallelVLM,
    adapter_for,
    build_model,
    prepare_batch,
)
from cpvlm.options import CPOptions  # noqa: E402
from cpvlm.verify import (  # noqa: E402
    mixed_batch,
    packed_documents,
    reference_loss_and_grads,
    rel_err,
    run_distributed,
)

NAMES = sorted(GEMMA)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_has_both_layer_kinds_a_short_window_and_gqa(name):
    model = cached_model(name)
    text = model.config.text_config
    kinds = set(text.layer_types)
    assert kinds == {"sliding_attention", "full_attention"}
    batch = mixed_batch(model, torch.float64)
    longest_span = max(b - a for a, b in prepare_batch(model, batch, 1).spans[0])
    assert text.sliding_window < longest_span < batch["attention_mask"].sum(-1).min()
    assert text.num_attention_heads == 2 * text.num_key_value_heads
    windows = {layer.self_attn.sliding_window for layer in model.model.language_model.layers}
    assert windows == {None, text.sliding_window}
    assert sum(p.numel() for p in model.parameters()) < 400_000
    # The projector starts random (transformers starts it at zero: no tower gradient at all).
    projector = dict(model.named_parameters())
    key = next(n for n in projector if "mm_input_projection" in n or "embed_vision" in n)
    assert projector[key].abs().max() > 0
    model32 = cached_model(name, torch.float32)
    for (n, p64), (_, p32) in zip(model.named_parameters(), model32.named_parameters()):
        assert torch.equal(p64, p32.double()), n


@pytest.mark.parametrize("name", NAMES)
def test_the_models_own_batch_converts_both_ways(name):
    """``to_model_batch`` gives what the model's forward takes (Gemma 3: [N, 3, H, W] images
    and token_type_ids; Gemma 4: padded patch sequences with positions), ``from_model_batch``
    gives the core's pixel rows and grids back exactly, and the core accepts either."""
    model = cached_model(name)
    adapter = adapter_for(model)
    batch = mixed_batch(model, torch.float64)
    native = adapter.to_model_batch(batch)
    assert "image_grid_thw" not in native
    if name == "gemma3-tiny":
        vc = model.config.vision_config
        assert native["pixel_values"].shape == (2, 3, vc.image_size, vc.image_size)
        assert torch.equal(native["token_type_ids"], batch["mm_token_type_ids"])
    else:
        assert native["pixel_values"].dim() == 3 and "image_position_ids" in native
        assert native["num_frames_per_video"].tolist() == [2]
    back = adapter.from_model_batch(native)
    for key, value in batch.items():
        assert torch.equal(back[key], value), key
    a, b = prepare_batch(model, batch, 2), prepare_batch(model, native, 2)
    assert torch.equal(a.grid_thw, b.grid_thw) and a.spans == b.spans
    assert torch.equal(a.pixel_values(torch.float64), b.pixel_values(torch.float64))


@pytest.mark.parametrize("name", NAMES)
def test_spans_are_transformers_image_blocks_in_padded_positions(name):
    """Each span is one block of transformers' own ``get_block_sequence_ids_for_mask`` (a run of
    image tokens; Gemma 4: image or video tokens), in the plan's padded positions, per document
    of a packed row (cp 3 pads every document)."""
    import importlib

    model = cached_model(name)
    family = "gemma3" if name == "gemma3-tiny" else "gemma4"
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    _, parts, doc_lens = packed_documents(model, torch.float64)
    packed = packed_documents(model, torch.float64)[0]
    prep = prepare_batch(model, packed, 3, doc_lens=doc_lens)
    expected, start = [], 0
    for part in parts:
        blocks = modeling.get_block_sequence_ids_for_mask(part["mm_token_type_ids"], device="cpu")
        for block in blocks[0].unique():
            if block >= 0:
                pos = torch.nonzero(blocks[0] == block).squeeze(1) + start
                padded = prep.plan.padded_index[pos]
                assert torch.equal(padded, torch.arange(padded[0], padded[-1] + 1))
                expected.append((int(padded[0]), int(padded[-1]) + 1))
        start += part["input_ids"].shape[1]
    assert len(expected) >= 4 and prep.spans == (tuple(expected),)


# ---- each part of the mask matters --------------------------------------------------------


def _changed(variant, ctx_spans_layers):
    """A bridge that builds the masks wrongly: ``variant`` drops the window or the spans, or puts
    the spans on every layer."""
    import cpvlm.integrations.hf.attention as bridge

    real = bridge._masks

    def masks(module, window, ctx, batch):
        if variant == "spans on every layer":
            ctx = dataclasses.replace(ctx, span_layers="all")
        out = real(module, window, ctx, batch)
        if variant == "no window":
            out = [(rows, dataclasses.replace(m, window=None)) for rows, m in out]
        elif variant == "no spans":
            out = [(rows, dataclasses.replace(m, spans=())) for rows, m in out]
        return out

    return bridge, real, masks


def _cp_losses(rank, world_size, name, variants):
    base = cached_model(name)
    batch = mixed_batch(base, torch.float64)
    losses = []
    for variant in variants:
        bridge, real, masks = _changed(variant, None)
        bridge._masks = masks
        try:
            cp = ContextParallelVLM(
                copy.deepcopy(base), dist.group.WORLD, options=CPOptions(attn="ring")
            )
            with torch.no_grad():
                loss = cp(**batch).loss
        finally:
            bridge._masks = real
        dist.all_reduce(loss)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("name", NAMES)
def test_the_window_and_the_image_spans_both_change_the_loss(name):
    model = cached_model(name)
    ref, _ = reference_loss_and_grads(model, mixed_batch(model, torch.float64))
    variants = ["real", "no window", "no spans"]
    if name == "gemma4-tiny":
        variants.append("spans on every layer")
    losses = run_distributed(_cp_losses, 2, name, variants)[0]
    errors = dict(
        zip(
            variants,
            (rel_err(torch.tensor(v, dtype=torch.float64), ref) for v in losses),
            strict=True,
        )
    )
    assert errors["real"] <= 1e-10, errors
    # Each wrong mask misses by orders of magnitude more than the exactness tolerance (measured:
    # 1e-3 .. 1e-2 relative on these tiny models).
    for variant in variants[1:]:
        assert errors[variant] > 1e-6, (variant, errors)


def test_data_path_gives_gemma3_processor_batches(tmp_path):
    """The data path on a Gemma 3 checkpoint (tokenizer, chat template, the PIL image processor):
    the same ids as ``Gemma3Processor.apply_chat_template(tokenize=True)`` (``\\n\\n<boi>``, 16
    image tokens, ``<eoi>\\n\\n`` per image), and each image's pixel rows are the processor's
    ``[N, 3, H, W]`` pixels in the core's layout; the core takes the processor's batch as it is."""
    from transformers import AutoConfig, AutoProcessor

    from cpvlm.data.record import Record
    from cpvlm.integrations.hf.processor import ChatEncoder
    from cpvlm.integrations.hf.tiny_checkpoint import make_tiny_checkpoint, write_images

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "gemma3")
    names = write_images(tmp_path, [(30, 50), (70, 20)])
    content = [
        {"type": "image", "image": str(tmp_path / names[0])},
        {"type": "text", "text": "Describe the image."},
        {"type": "image", "image": str(tmp_path / names[1])},
    ]
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": "two cats"}]},
    ]
    processor = AutoProcessor.from_pretrained(ckpt, local_files_only=True)
    out = processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt"
    )
    config = AutoConfig.from_pretrained(ckpt, local_files_only=True)
    encoder = ChatEncoder(ckpt, config)
    plan = encoder.plan(Record(0, "x", {"messages": messages}, tmp_path))
    assert torch.equal(plan.input_ids, out["input_ids"][0])
    assert int((plan.input_ids == config.image_token_id).sum()) == 2 * 16
    assert (plan.labels != -100).any() and (
        plan.labels[plan.input_ids == config.image_token_id] == -100
    ).all()
    rows = torch.cat([encoder.decode(item, None) for item in plan.images])
    adapter = adapter_for(config)
    core = adapter.from_model_batch({**out, "labels": out["input_ids"]})
    assert torch.equal(rows, core["pixel_values"])
    assert torch.equal(core["mm_token_type_ids"], out["token_type_ids"])
    model = build_model(ckpt)  # the checkpoint round trip, with the tokenizer's ids
    prep = prepare_batch(model, {**out, "labels": out["input_ids"]}, 2)
    assert [b - a for a, b in prep.spans[0]] == [16, 16]


# ---- no dense mask under CP ------------------------------------------------------------------


def _masks_built(rank, world_size, name):
    """Per mask transformers asks for, whether one was built (not None): in a CP forward, then in
    the wrapped model's own forward (no ``cpvlm_cp``: transformers' sdpa path)."""
    from transformers.masking_utils import AttentionMaskInterface

    import cpvlm.integrations.hf.attention as bridge

    base = cached_model(name)
    batch = mixed_batch(base, torch.float64)
    built: list[bool] = []

    def spy(*args, **kwargs):
        out = bridge.context_parallel_mask(*args, **kwargs)
        built.append(out is not None)
        return out

    AttentionMaskInterface.register(bridge.CP_ATTENTION, spy)
    try:
        cp = ContextParallelVLM(
            copy.deepcopy(base), dist.group.WORLD, options=CPOptions(attn="ring")
        )
        with torch.no_grad():
            cp(**batch)
            in_cp = list(built)
        built.clear()
        reference_loss_and_grads(cp.model, batch)  # the model's own batch and forward
    finally:
        AttentionMaskInterface.register(bridge.CP_ATTENTION, bridge.context_parallel_mask)
    return in_cp, built


@pytest.mark.parametrize("name", NAMES)
def test_a_cp_forward_builds_no_dense_mask(name):
    # Sliding windows and image spans make sdpa's masks dense [B, 1, S_loc, S_loc] bools (1 GiB a
    # kind at 32k local tokens); the CP attention never reads them, so a CP forward builds none.
    for in_cp, own in run_distributed(_masks_built, 2, name):
        assert in_cp and not any(in_cp), in_cp  # asked for, none built
        assert own and all(own), own  # the same model outside CP: its masks are dense
