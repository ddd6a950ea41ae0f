"""Gemma 4 with its audio tower (gemma4-audio-tiny) under CP.

The shared family tests (hf_families.FAMILIES) run gemma4-audio-tiny like every tiny model, and
tests/hf/test_gemma.py its masks and image layout; here: what audio adds. A clip's rows are
the processor's count (``audio_rows`` against ``Gemma4Processor.replace_audio_token``) and the
tower's; the processor's audio is the core's, both ways; a clip encoded alone gives the rows
the model computes for it in its padded batch; under CP at 2 and 3 ranks, ring and allgather
attention, on packed documents with a rank that holds neither audio nor image positions, each
clip is encoded on exactly one rank and the loss and every gradient equal the one-process model;
the audio cost model counts the tower's MACs.

Reference: the model's own one-process forward and backward (``cpvlm.verify.reference``), its
float32 parts (RMSNorm, the vision pooler, the audio attention) computed in float64 in both runs
(the kit's ``float64_islands``). float64 tolerance 1e-10 (measured: 1e-13 and below).
"""

import copy
import types

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_families import cached_model, grad_errors  # noqa: E402

from cpvlm import CPOptions  # noqa: E402
from cpvlm.hf import (  # noqa: E402
    ContextParallelVLM,
    SampleSpec,
    adapter_for,
    pack_documents,
    prepare_batch,
    synthetic_batch,
)
from cpvlm.verify import cp_loss_and_grads, reference, rel_err, run_distributed  # noqa: E402

NAME = "gemma4-audio-tiny"
TIMEOUT = 600  # s; seconds on an idle 2-core machine, minutes when it is shared
TOL = 1e-10


def test_rows_are_the_processors_and_the_towers():
    """``audio_rows(n)`` is what ``Gemma4Processor.replace_audio_token`` writes for a clip of n
    valid frames padded to any length, and the rows the tower's output mask keeps."""
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    model = cached_model(NAME)
    adapter = adapter_for(model)
    stand_in = types.SimpleNamespace(boa_token="<", audio_token="a", eoa_token=">")
    lengths = list(range(1, 23)) + [37, 150]
    frames = max(lengths) + 3
    mask = torch.arange(frames) < torch.tensor(lengths)[:, None]
    for i, n in enumerate(lengths):
        text = Gemma4Processor.replace_audio_token(stand_in, {"input_features_mask": mask}, i)
        assert text == "<" + "a" * adapter.audio_rows(n) + ">", n
    features = torch.randn(len(lengths), frames, adapter.audio_feature_width, dtype=torch.float64)
    with torch.no_grad():
        out = model.model.get_audio_features(features, mask, return_dict=True)
    assert out.attention_mask.sum(1).tolist() == [adapter.audio_rows(n) for n in lengths]


def test_the_processors_audio_is_the_cores():
    """The processor's ``input_features`` [clips, T, F] zero-padded with its boolean
    ``input_features_mask`` are the core's ``audio_features`` (valid frames, clip after clip) and
    ``audio_lengths``, and back; ``<boa> rows <eoa>`` per clip, the rows of token type 3."""
    model = cached_model(NAME)
    adapter = adapter_for(model)
    c = model.config
    batch = synthetic_batch(c, audios=(150, 37), text_len=6, dtype=torch.float64, seed=2)
    own = adapter.to_model_batch(batch)
    assert "audio_features" not in own and "audio_lengths" not in own
    assert own["input_features"].shape == (2, 150, 16)
    assert own["input_features_mask"].dtype == torch.bool
    assert own["input_features_mask"].sum(1).tolist() == [150, 37]
    assert not own["input_features"][1, 37:].any()
    assert torch.equal(own["input_features"][1, :37], batch["audio_features"][150:])
    core = adapter.from_model_batch(own)
    assert torch.equal(core["audio_features"], batch["audio_features"])
    assert core["audio_lengths"].tolist() == [150, 37]
    ids = batch["input_ids"][0]
    assert int((ids == c.boa_token_id).sum()) == int((ids == c.eoa_token_index).sum()) == 2
    assert int((batch["mm_token_type_ids"] == 3).sum()) == 38 + 10
    assert prepare_batch(model, own, 2).audio_lengths == (150, 37)
    shifted = own["input_features_mask"].roll(1, dims=1)  # not the leading frames
    with pytest.raises(ValueError, match="leading frames"):
        adapter.from_model_batch({**own, "input_features_mask": shifted})
    with pytest.raises(ValueError, match="audio_features has shape"):
        prepare_batch(model, {**batch, "audio_lengths": torch.tensor([150, 30])}, 2)


def test_a_clip_alone_is_its_rows_in_the_batch():
    """A clip encoded alone (as a CP rank encodes it) gives the rows the model computes for it
    padded in a batch with a longer clip, and the same gradients of the tower: its padding is
    masked before each convolution and in the attention, and the convolution is causal."""
    model = cached_model(NAME)
    adapter = adapter_for(model)
    batch = synthetic_batch(model.config, audios=(150, 37), text_len=6, dtype=torch.float64)
    own = adapter.to_model_batch(batch)
    out = model.model.get_audio_features(own["input_features"], own["input_features_mask"])
    whole = out.pooler_output[out.attention_mask]
    short = batch["audio_features"][150:]
    alone = adapter.encode_audio(model, short, torch.tensor([37]), (150, 37))
    assert alone.shape == (10, model.config.text_config.hidden_size)
    assert rel_err(alone, whole[38:]) <= 1e-13  # other matmul shapes only
    weights = torch.randn_like(alone)
    params = [p for p in model.model.audio_tower.parameters() if p.requires_grad]
    a = torch.autograd.grad((alone * weights).sum(), params)
    b = torch.autograd.grad((whole[38:] * weights).sum(), params)
    for ga, gb in zip(a, b, strict=True):
        assert rel_err(ga, gb) <= 1e-12


def _documents(model):
    """A packed row: an image and the 150-frame clip amid 150 text tokens, a text document,
    the 37-frame clip amid 60. Text comes first and last in each document (a third each), so
    rank 0 (head-tail: chunks 0 and 2 cp - 1 of every document) holds neither audio nor image
    positions at cp 2 and 3."""
    docs = [
        SampleSpec(images=((4, 4),), audios=(150,), text_len=150),
        SampleSpec(text_len=5),
        SampleSpec(audios=(37,), text_len=60),
    ]
    parts = [
        synthetic_batch(model.config, [d], dtype=torch.float64, seed=20 + i)
        for i, d in enumerate(docs)
    ]
    for p in parts:
        p.pop("attention_mask")
    return pack_documents(parts), [p["input_ids"].shape[1] for p in parts]


def _bare_ranks(model, batch, doc_lens, cp) -> set[int]:
    """The CP ranks whose shard holds no image, video or audio position."""
    prep = prepare_batch(model, batch, cp, doc_lens=doc_lens)
    rows = torch.cat([prep.row_positions, prep.audio_row_positions])
    owners = set(prep.plan.locate(rows)[0].tolist())
    return set(range(cp)) - owners


def _cp(rank, world_size, batch, doc_lens, cases):
    base = cached_model(NAME)
    results = []
    for attn, vision in cases:
        model = copy.deepcopy(base)
        clips = []
        model.model.audio_tower.register_forward_hook(
            lambda m, args, out, clips=clips: clips.append(int(args[0].shape[0]))
        )
        options = CPOptions(attn=attn, vision=vision)
        cp_model = ContextParallelVLM(model, dist.group.WORLD, options=options)
        out, loss, grads = cp_loss_and_grads(cp_model, batch, doc_lens)
        results.append(
            {
                "loss": loss,
                "grads": grads if rank == 0 else None,
                "encoded": out.encoded_audio,
                "clips": clips,
            }
        )
    return results


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_matches_one_process_with_audio(cp):
    """Loss and every parameter gradient (audio tower and embedder included) equal the
    one-process model's at 1e-10, with ring and allgather attention (and the audio rows
    all-gathered instead of routed); each clip is encoded on exactly one rank (the tower called
    once per rank, a rank without a clip on a dummy one)."""
    model = cached_model(NAME)
    batch, doc_lens = _documents(model)
    assert _bare_ranks(model, batch, doc_lens, cp) == {0}  # no audio, no image positions
    ref_loss, ref_grads = reference(model, batch, doc_lens)
    cases = [("ring", "route"), ("allgather", "route"), ("ring", "allgather")]
    per_rank = run_distributed(_cp, cp, batch, doc_lens, cases, timeout=TIMEOUT)
    for i, case in enumerate(cases):
        results = [r[i] for r in per_rank]
        encoded = [r["encoded"] for r in results]
        assert sum(encoded) == 2 and max(encoded) == 1, (case, encoded)  # two clips, two ranks
        assert [r["clips"] for r in results] == [[max(e, 1)] for e in encoded], case
        errs = grad_errors(NAME, results[0]["grads"], ref_grads)
        worst = max(errs, key=errs.get)
        loss_err = rel_err(results[0]["loss"], ref_loss)
        print(f"cp={cp} {case}: encoded {encoded}, loss {loss_err:.1e}, {worst} {errs[worst]:.1e}")
        assert loss_err <= TOL and errs[worst] <= TOL, (case, loss_err, worst, errs[worst])
        assert any(n.startswith("model.audio_tower.") for n in errs)
        assert any(n.startswith("model.embed_audio.") for n in errs)


def test_audio_cost_counts_the_towers_macs():
    """``audio_cost`` (linear per frame: the windowed attention has a fixed context per row) is
    the forward MACs torch's FlopCounterMode counts in ``get_audio_features`` on one clip, to 5%:
    it leaves out a per-call part (the relative-position keys) and the last chunk's padding
    (measured 0.97 at 16 frames, 0.98 at 150, 0.999 at 1000)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = cached_model(NAME)
    adapter = adapter_for(model)
    cost = adapter.audio_cost()
    for n in (16, 150, 1000):
        features = torch.randn(1, n, adapter.audio_feature_width, dtype=torch.float64)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model.model.get_audio_features(features, torch.ones(1, n, dtype=torch.bool))
        ratio = cost.unit_cost((1, 1, n)) / (counter.get_total_flops() / 2)
        assert 0.95 <= ratio <= 1.0, (n, ratio)


def test_a_checkpoint_with_audio_loads(tmp_path):
    """``build_model`` on a Gemma 4 checkpoint with an audio tower: transformers refuses "sdpa"
    for a model whose audio tower has only an eager attention, so the tower loads eager and the
    rest with the asked attention."""
    from cpvlm.hf import build_model

    model = cached_model(NAME, torch.float32)
    model.save_pretrained(tmp_path)
    loaded = build_model(tmp_path)
    assert loaded.model.audio_tower.config._attn_implementation == "eager"
    assert loaded.model.language_model.config._attn_implementation == "sdpa"
    assert loaded.model.vision_tower.config._attn_implementation == "sdpa"
    for (n, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(a, b), n
