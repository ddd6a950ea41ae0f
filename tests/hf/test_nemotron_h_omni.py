"""Nemotron 3 Nano Omni (Mamba-2, attention and MoE blocks; a RADIO tower beside a projector; a
Parakeet audio encoder) under CP.

The shared family tests (hf_families.FAMILIES) run nemotron-omni-tiny at cp 2 and 4 (mixed, packed,
a rank without images, text-only, float32); here: cp 3 in every attention and vision mode, the
naive CP that the Mamba-2 integration rules out, the unchanged model's float32 parts, the layer
swap, the float64 islands, the refused video inputs, the router's distance from ties and the
tower's cost model; and audio: the Parakeet extractor's layout <-> the core's, the row count,
the audio BatchNorm on running statistics, the "+1" row of a clip with n % 8 == 0 (its padding to
the batch's longest clip, and a check that fails without it), CP at cp 2 and 3 with each clip
encoded on exactly one rank, and the audio cost model.

Reference: the model's own one-process forward and backward (each packed document alone), its
float32 parts read in float64 in both runs (the kit's ``float64_islands``). float64 tolerance
1e-10: measured <= 2e-15 for the loss and every gradient (the key biases, zero in exact arithmetic,
against their group's scale).
"""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_families import cached_model, grad_errors  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from transformers import ParakeetFeatureExtractor  # noqa: E402
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer  # noqa: E402
from transformers.models.nemotron_h_omni import processing_nemotron_h_omni  # noqa: E402

from cpvlm.families.nemotron_h_omni import (  # noqa: E402
    ContextParallelNemotronHMamba2Mixer,
    RunningStatsBatchNorm1d,
    parakeet_audio_cost,
    radio_vision_cost,
)
from cpvlm.hf import (  # noqa: E402
    ContextParallelVLM,
    SampleSpec,
    adapter_for,
    prepare_batch,
    synthetic_batch,
)
from cpvlm.hf.vision_cost import vision_cost  # noqa: E402
from cpvlm.options import CPOptions  # noqa: E402
from cpvlm.verify import (  # noqa: E402
    cp_loss_and_grads,
    mixed_batch,
    packed_documents,
    reference,
    rel_err,
    run_distributed,
)

NAME = "nemotron-omni-tiny"
TIMEOUT = 600  # s; seconds on an idle 2-core machine, minutes when it is shared
CONFIGS = [
    ("ring", "route", "scalable"),
    ("allgather", "allgather", "compat"),
    ("ulysses", "route", "scalable"),
    ("ring", "replicate", "scalable"),
]


def _batch(model, kind):
    if kind == "packed":
        packed, _, doc_lens = packed_documents(model, torch.float64)
        return packed, doc_lens
    return mixed_batch(model, torch.float64), None


class _NaiveMixer(NemotronHMamba2Mixer):
    """transformers' mixer on a rank's own shard: zero conv history, zero state at its start."""

    def forward(self, hidden_states, cache=None, attention_mask=None, cpvlm_cp=None, **kwargs):
        return super().forward(hidden_states)


def _cp(rank, world_size, cases, islands=True, naive=False):
    base = cached_model(NAME, islands=islands)
    results = []
    for kind, (attn, vision, flow) in cases:
        batch, doc_lens = _batch(base, kind)
        model = copy.deepcopy(base)
        cp_model = ContextParallelVLM(
            model, dist.group.WORLD, options=CPOptions(attn=attn, vision=vision, flow=flow)
        )
        if naive:
            for module in model.modules():
                if isinstance(module, NemotronHMamba2Mixer):
                    module.__class__ = _NaiveMixer
        out, loss, grads = cp_loss_and_grads(cp_model, batch, doc_lens)
        results.append({"loss": loss, "grads": grads if rank == 0 else None})
    return results


def _errors(result, ref_loss, ref_grads):
    return rel_err(result["loss"], ref_loss), grad_errors(NAME, result["grads"], ref_grads)


@pytest.mark.parametrize("kind", ["mixed", "packed"])
def test_cp3_every_mode_matches_one_process_float64(kind):
    """cp 3 (pieces of 1/6 of the row, documents cut mid-chunk): ring, all-gather K/V and
    Ulysses (4 query and 2 key/value heads over 3 ranks), both vision collectives and the
    replicated tower."""
    cases = [(kind, c) for c in CONFIGS]
    model = cached_model(NAME)
    ref_loss, ref_grads = reference(model, *_batch(model, kind))
    per_rank = run_distributed(_cp, 3, cases, timeout=TIMEOUT)
    mamba = [n for n in ref_grads if ".mixer.A_log" in n or ".mixer.conv1d." in n]
    assert len(mamba) == 6 and all(ref_grads[n].abs().max() > 0 for n in mamba)
    for i, (_, config) in enumerate(cases):
        loss_err, errs = _errors(per_rank[0][i], ref_loss, ref_grads)
        worst = max(errs, key=errs.get)
        print(f"cp=3 {kind} {config}: loss {loss_err:.1e}, worst {worst} {errs[worst]:.1e}")
        tol = 1e-6 if config[1] == "replicate" else 1e-10  # as the shared tests: partial sums
        assert loss_err <= 1e-10 and errs[worst] <= tol, (config, worst, errs[worst])


def test_naive_cp_mamba_fails_the_same_check():
    """Each rank running transformers' Mamba-2 mixer on its own shard (what sharding the sequence
    alone gives) is far from the one-process model: the check can fail."""
    model = cached_model(NAME)
    ref_loss, ref_grads = reference(model, *_batch(model, "packed"))
    cases = [("packed", CONFIGS[0])]
    (result,) = run_distributed(_cp, 2, cases, True, True, timeout=TIMEOUT)[0]
    loss_err, errs = _errors(result, ref_loss, ref_grads)
    assert loss_err > 1e-4, loss_err
    mamba = {n: e for n, e in errs.items() if ".mixer.conv1d." in n or ".mixer.in_proj." in n}
    assert len(mamba) == 6 and min(mamba.values()) > 1e-3, mamba


def test_unchanged_model_differs_by_its_float32_parts_only():
    """Without the float64 islands the model's own forward computes the Mamba-2 scan, its gated
    norm, the RMSNorms' weight products (the projectors' too), the router and the logits in
    float32, while CP computes the mixers in float64: the CP loss and gradients stay within float32
    round-off amplified by the recurrence. Measured: loss 1.1e-7, every gradient <= 9.4e-7 (the
    audio tower's last norm; without audio in the batch: loss 8.5e-9, the routers' 3e-7)."""
    model = cached_model(NAME, islands=False)
    ref_loss, ref_grads = reference(model, *_batch(model, "mixed"))
    (result,) = run_distributed(_cp, 2, [("mixed", CONFIGS[0])], False, timeout=TIMEOUT)[0]
    loss_err, errs = _errors(result, ref_loss, ref_grads)
    worst = max(errs, key=errs.get)
    print(f"unchanged model: loss {loss_err:.1e}, worst {worst} {errs[worst]:.1e}")
    assert loss_err <= 1e-6 and errs[worst] <= 1e-5, (loss_err, worst, errs[worst])


def test_mamba_layers_become_cp_aware_in_place():
    """The swap keeps the module objects, parameter names and the model's own forward (without the
    CP context), and is idempotent; every Mamba-2 mixer is swapped, nothing else."""
    model = copy.deepcopy(cached_model(NAME, islands=False))
    batch = mixed_batch(model, torch.float64)
    inputs = adapter_for(model).to_model_batch({k: v for k, v in batch.items() if k != "labels"})
    with torch.no_grad():
        before = model(**inputs, use_cache=False).logits
        keys, modules = list(model.state_dict()), list(model.modules())
        adapter = adapter_for(model)
        adapter.install_context_parallel(model)
        adapter.install_context_parallel(model)
        after = model(**inputs, use_cache=False).logits
    assert list(model.state_dict()) == keys and list(model.modules()) == modules
    swapped = [m for m in modules if isinstance(m, NemotronHMamba2Mixer)]
    assert len(swapped) == model.config.text_config.layers_block_type.count("linear_attention")
    assert all(type(m) is ContextParallelNemotronHMamba2Mixer for m in swapped)
    assert torch.equal(after, before)


class _NarrowOps(TorchDispatchMode):
    """Records every aten op that returns a floating tensor narrower than float64, but for one
    value per audio clip without gradient (Parakeet's and ``get_audio_features``' subsampled
    lengths: integer arithmetic done in float32, exact below 2**24 frames)."""

    def __init__(self, clips=0):
        super().__init__()
        self.ops, self.clips = set(), clips

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            narrow = (
                isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
            )
            if narrow and (t.shape != (self.clips,) or t.requires_grad):
                self.ops.add(str(func))
        return out


def test_float64_islands_leave_no_float32_in_the_model():
    """With ``float64_islands`` the float64 model's own forward and backward (tower, projector,
    audio encoder and projector, Mamba-2, attention, router and experts, logits) computes nothing
    in float32; without them it does (the islands are needed)."""
    batch = mixed_batch(cached_model(NAME), torch.float64)
    inputs = adapter_for(cached_model(NAME)).to_model_batch(
        {k: v for k, v in batch.items() if k != "labels"}
    )
    for islands in (True, False):
        model = cached_model(NAME, islands=islands)
        with _NarrowOps(clips=len(batch["audio_lengths"])) as seen:
            model(**inputs, use_cache=False).logits.square().mean().backward()
        model.zero_grad(set_to_none=True)
        assert not seen.ops if islands else seen.ops, sorted(seen.ops)


def test_router_choices_are_far_from_ties():
    """The exactness tests compare two float64 runs whose hidden states differ by round-off: a
    top-k choice within round-off of a tie could flip. The tiny model's smallest gap between the
    k-th and (k+1)-th expert score (sigmoid, plus the correction bias), over every batch of the
    tests, is far above it (measured 9.4e-5)."""
    model = cached_model(NAME)
    text = model.config.text_config
    batches = [mixed_batch(model, torch.float64), *packed_documents(model, torch.float64)[1]]
    single = [SampleSpec(images=((4, 4),), text_len=60)]
    batches.append(synthetic_batch(model.config, single, dtype=torch.float64, seed=2))
    routers = [m for m in model.modules() if type(m).__name__ == "NemotronHTopkRouter"]
    logits = []
    hooks = [r.register_forward_hook(lambda m, i, out: logits.append(out[0])) for r in routers]
    try:
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            with torch.no_grad():
                model(**adapter_for(model).to_model_batch(inputs), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(logits) == len(batches) * len(routers) == len(batches) * 2
    k = text.num_experts_per_tok
    gaps = []
    for layer_logits in logits:
        scores = layer_logits.sigmoid().sort(-1, descending=True).values
        gaps.append(float((scores[:, k - 1] - scores[:, k]).min()))
    print(f"smallest top-k gap {min(gaps):.1e}")
    assert min(gaps) > 1e-9, min(gaps)


def test_video_inputs_are_refused_by_name():
    model = cached_model(NAME)
    with pytest.raises(ValueError, match="videos are not supported yet"):
        synthetic_batch(model.config, [SampleSpec(videos=((2, 4, 4),), text_len=4)])
    assert not adapter_for(model).takes_videos


def test_the_models_own_batch_and_grids():
    """The model's own keys (``image_grid_hw``) are the core's with t = 1, both ways."""
    model = cached_model(NAME)
    adapter = adapter_for(model)
    batch = mixed_batch(model, torch.float64)
    own = adapter.to_model_batch(batch)
    assert "image_grid_thw" not in own and own["image_grid_hw"].tolist() == [[4, 4], [8, 4]]
    core = adapter.from_model_batch(own)
    assert torch.equal(core["image_grid_thw"], batch["image_grid_thw"])
    prep = prepare_batch(model, own, 2)
    assert prep.grid_thw.tolist() == [[1, 4, 4], [1, 8, 4]]
    assert int(prep.visual_mask.sum()) == (16 + 32) // 4


def test_vision_cost_counts_the_towers_matrix_products():
    """The cost model is the tower's, projector's and patch embedding's matrix products of an
    image, but for the P prefix tokens (cls and registers) it leaves out: torch's FLOP counter on
    ``encode`` (eager attention) equals 2 * (unit cost + the prefix tokens' work) exactly."""
    model = copy.deepcopy(cached_model(NAME, islands=False))
    model.config.vision_config._attn_implementation = "eager"
    adapter = adapter_for(model)
    cost = vision_cost(model)
    assert cost == radio_vision_cost(model.config) == adapter.vision_cost()
    vc = model.config.vision_config
    w, depth, p = vc.hidden_size, vc.num_hidden_layers, vc.num_summary_tokens
    per_token = 4 * w * w + 2 * w * int(w * vc.mlp_ratio)
    for grid in ([1, 4, 4], [1, 8, 6], [1, 2, 2]):
        n = grid[1] * grid[2]
        pixels = torch.randn(n, adapter.pixel_width, dtype=torch.float64)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            adapter.encode(model, pixels, torch.tensor([grid]))
        prefix = depth * (p * per_token + 2 * w * ((n + p) ** 2 - n * n))
        assert counter.get_total_flops() == 2 * (cost.unit_cost(tuple(grid)) + prefix), grid


# ---- audio ---------------------------------------------------------------------------------------


def _extracted(samples):
    """The Parakeet extractor's output (16 mel bins, the tiny encoder's) for random waveforms of
    ``samples`` each: n = samples // 160 valid frames per clip, n + 1 given."""
    extractor = ParakeetFeatureExtractor(feature_size=16)
    waves = [torch.randn(n, generator=torch.Generator().manual_seed(n)).numpy() for n in samples]
    out = extractor(waves, sampling_rate=16000, return_tensors="pt")
    return out["input_features"].double(), out["attention_mask"]


def test_the_extractors_audio_is_the_cores():
    """The extractor's ``input_features`` [clips, longest n + 1, F] with its mask of the n valid
    frames are the core's ``audio_features`` (the valid frames) and ``audio_lengths``, and back
    exactly; a clip's placeholders are the processor's count, the model's rows and the adapter's
    ``audio_rows``; what the core could not give back is refused."""
    model = cached_model(NAME)
    adapter = adapter_for(model)
    features, mask = _extracted((12345, 7680))  # n = 77 and 48
    assert features.shape == (2, 78, 16) and mask.sum(1).tolist() == [77, 48]
    own = {"input_features": features, "input_features_mask": mask}
    core = adapter.from_model_batch(own)
    assert core["audio_lengths"].tolist() == [77, 48] and "input_features" not in core
    assert torch.equal(core["audio_features"], torch.cat([features[0, :77], features[1, :48]]))
    back = adapter.to_model_batch(core)
    assert torch.equal(back["input_features"], features)
    assert torch.equal(back["input_features_mask"], mask)

    with torch.no_grad():
        rows = model.get_audio_features(features, mask).pooler_output
    assert len(rows) == adapter.audio_rows(77) + adapter.audio_rows(48) == 10 + 7
    estimate = processing_nemotron_h_omni.NemotronH_Omni_Reasoning_V3Processor
    processor = SimpleNamespace(audio_hop_length=160, audio_subsampling_factor=8)
    for samples in (80, 160, 1280, 1439, 7680, 7839, 12345):
        n = samples // 160
        assert adapter.audio_rows(n) == estimate._estimate_audio_num_embeddings(processor, samples)

    batch = synthetic_batch(model.config, audios=(77, 48), text_len=3, seed=2)
    ids = batch["input_ids"][0].tolist()
    start = ids.index(adapter.audio_start_token_id)
    assert ids[start : start + 12] == [adapter.audio_start_token_id, *[506] * 10, 508]
    assert int((batch["mm_token_type_ids"] == 3).sum()) == 17
    assert set(adapter.special_token_ids) >= {506, 507, 508}

    noisy = features.clone()
    noisy[1, 60] = 1.0  # a masked frame that is not the extractor's zero
    longer = torch.cat([features, features[:, :1] * 0], dim=1)  # T beyond the longest n + 1
    holes = mask.clone()
    holes[0, 3] = False  # not a prefix
    for f, m in (
        (noisy, mask),
        (longer, torch.cat([mask, mask[:, :1] & False], 1)),
        (features, holes),
    ):
        with pytest.raises(ValueError, match="nemotron_h_omni: input_features"):
            adapter.from_model_batch({"input_features": f, "input_features_mask": m})


def test_the_audio_batch_norm_runs_on_running_statistics():
    """transformers' train-mode BatchNorm normalises by statistics over the whole call, padding
    included: a clip encoded alone is not what the batched call computes for it (the check can
    fail). The adapter's ``install_context_parallel`` (and the kit, for the reference) gives the
    audio tower's BatchNorm layers ``RunningStatsBatchNorm1d``: the same parameters and buffers,
    the running statistics left as they are, and then a clip alone is the batch's."""
    model = copy.deepcopy(cached_model(NAME))
    adapter = adapter_for(model)
    norms = [m for m in model.audio_tower.modules() if isinstance(m, nn.BatchNorm1d)]
    assert len(norms) == 2 and all(type(m) is RunningStatsBatchNorm1d for m in norms)
    features, mask = _extracted((12345, 7680))
    core = adapter.from_model_batch({"input_features": features, "input_features_mask": mask})
    clip, lengths, batch = core["audio_features"][:77], torch.tensor([77]), (77, 48)

    def errors():
        with torch.no_grad():
            whole = model.get_audio_features(features, mask).pooler_output[:10]
            return rel_err(adapter.encode_audio(model, clip, lengths, batch), whole)

    stats = [m.running_mean.clone() for m in norms]
    assert model.training and errors() <= 1e-13
    assert all(torch.equal(m.running_mean, s) for m, s in zip(norms, stats, strict=True))
    keys = list(model.state_dict())
    for m in norms:
        m.__class__ = nn.BatchNorm1d  # transformers' own, in train mode
    assert errors() > 1e-3
    adapter.install_context_parallel(model)
    assert all(type(m) is RunningStatsBatchNorm1d for m in norms)
    assert list(model.state_dict()) == keys and errors() <= 1e-13


def test_the_plus_one_row_is_padded_as_in_its_batch():
    """A clip of n % 8 == 0 frames has one row more than its subsampled mask (f(n + 1) rows):
    that row attends over all rows of the padded clip, so it depends on the batch's longest clip.
    ``encode_audio`` with the batch's lengths gives the model's rows of the batched call; padded
    to itself alone, the last row (only) differs. A clip of n % 8 != 0 frames has no such row:
    ``encode_audio`` pads it to its own longest (here 26 frames, the batch's 78), and its rows are
    the batched call's all the same."""
    model = cached_model(NAME)
    adapter = adapter_for(model)
    features, mask = _extracted((12345, 7680, 4000))  # n = 77, 48, 25
    core = adapter.from_model_batch({"input_features": features, "input_features_mask": mask})
    clips, batch = torch.split(core["audio_features"], [77, 48, 25]), (77, 48, 25)
    with torch.no_grad():
        whole = torch.split(model.get_audio_features(features, mask).pooler_output, [10, 7, 4])
        in_batch = adapter.encode_audio(model, clips[1], [48], batch)
        alone = adapter.encode_audio(model, clips[1], [48], (48,))
        short = adapter.encode_audio(model, clips[2], [25], batch)
    assert [adapter.audio_rows(n) for n in batch] == [10, 7, 4]
    assert rel_err(in_batch, whole[1]) <= 1e-13  # other matmul shapes
    assert rel_err(alone[:-1], whole[1][:-1]) <= 1e-13
    assert rel_err(alone[-1], whole[1][-1]) > 1e-8, rel_err(alone[-1], whole[1][-1])
    assert rel_err(short, whole[2]) <= 1e-13


def _padded_to_own_longest(adapter):
    """``encode_audio`` told no other clip of the batch: this rank's clips padded to their own
    longest."""
    own = type(adapter).encode_audio
    return lambda model, features, lengths, batch_lengths: own(
        adapter, model, features, lengths, ()
    )


def _cp_audio(rank, world_size, cases):
    base = cached_model(NAME)
    results = []
    for kind, attn, broken in cases:
        batch, doc_lens = _batch(base, kind)
        model = copy.deepcopy(base)
        calls = []
        model.audio_tower.register_forward_hook(
            lambda m, args, kwargs, out, calls=calls: calls.append(
                kwargs["attention_mask"].sum(1).tolist()
            ),
            with_kwargs=True,
        )
        cp_model = ContextParallelVLM(model, dist.group.WORLD, options=CPOptions(attn=attn))
        adapter = cp_model.adapter
        if broken:  # each rank pads its clips to its own longest, not the batch's
            adapter.encode_audio = _padded_to_own_longest(adapter)
        try:
            out, loss, grads = cp_loss_and_grads(cp_model, batch, doc_lens)
        finally:
            adapter.__dict__.pop("encode_audio", None)
        results.append(
            {
                "loss": loss,
                "grads": grads if rank == 0 else None,
                "calls": calls,
                "images": out.encoded_units,
                "clips": out.encoded_audio,
            }
        )
    return results


@pytest.mark.parametrize("cp", [2, 3])
def test_audio_under_cp_is_exact_and_encoded_once(cp):
    """Float64 gloo CP on the verify batches (the mixed batch's clip of 75 frames; a packed row
    whose audio document holds 75 and 48 frames, the "+1" row beside the longer clip), ring and
    all-gather attention: loss and every gradient equal the one-process model's to 1e-10 (measured
    <= 1e-14); each rank calls the audio tower once, and each clip is encoded on exactly one rank
    (a rank without clips encodes a 1-frame dummy); at cp 3 the mixed batch's clip goes to a rank
    that encodes no image (clips balance around the vision work).
    At cp 2 the packed row's two clips are encoded on two ranks, and with each rank padding its
    clips to its own longest (not the batch's) the 48-frame clip's "+1" row is another: the check
    fails (loss and audio gradients > 1e-9)."""
    model = cached_model(NAME)
    cases = [(k, a, False) for k in ("mixed", "packed") for a in ("ring", "allgather")]
    cases += [("packed", "ring", True)] if cp == 2 else []
    refs = {kind: reference(model, *_batch(model, kind)) for kind in ("mixed", "packed")}
    clips = {kind: _batch(model, kind)[0]["audio_lengths"].tolist() for kind in refs}
    assert clips == {"mixed": [75], "packed": [75, 48]}
    per_rank = run_distributed(_cp_audio, cp, cases, timeout=TIMEOUT)
    for i, (kind, attn, broken) in enumerate(cases):
        runs = [r[i] for r in per_rank]
        assert all(len(r["calls"]) == 1 for r in runs)
        encoded = [n for r in runs if r["clips"] for n in r["calls"][0]]
        assert sorted(encoded) == sorted(clips[kind]), runs
        assert all(r["calls"][0] == [1] for r in runs if not r["clips"])  # the dummy clip
        if cp == 3 and kind == "mixed":  # the clip balanced around the images' work
            assert any(r["clips"] == 0 for r in runs)
            assert all(r["images"] == 0 for r in runs if r["clips"])
        ref_loss, ref_grads = refs[kind]
        loss_err, errs = _errors(runs[0], ref_loss, ref_grads)
        audio = max(e for n, e in errs.items() if n.startswith("audio_tower."))
        worst = max(errs, key=errs.get)
        print(f"cp={cp} {kind} {attn} broken={broken}: loss {loss_err:.1e}, audio {audio:.1e}")
        if broken:
            assert [r["calls"][0] for r in runs if r["clips"]] in ([[75], [48]], [[48], [75]])
            assert loss_err > 1e-9 and audio > 1e-9, (loss_err, audio)
        else:
            assert loss_err <= 1e-10 and errs[worst] <= 1e-10, (kind, attn, worst, errs[worst])


def test_audio_cost_counts_the_encoders_matrix_products():
    """The audio cost model (1/64 MAC) against torch's FLOP counter on ``encode_audio`` of one
    clip (eager attention): within 1%, measured 0.05% (it counts n / 8 rows where the encoder has
    f(n + 1), and 2r relative keys where it has 2r - 1); quadratic in the clip's length."""
    model = copy.deepcopy(cached_model(NAME, islands=False))
    model.config.audio_config._attn_implementation = "eager"
    adapter = adapter_for(model)
    cost = adapter.audio_cost()
    assert cost == parakeet_audio_cost(model.config) and cost.full_blocks == 2
    for n in (799, 1599):
        features = torch.randn(n, adapter.audio_feature_width, dtype=torch.float64)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            adapter.encode_audio(model, features, torch.tensor([n]), (n,))
        counted = counter.get_total_flops() / 2
        modelled = cost.unit_cost((1, 1, n)) / 64
        print(f"n={n}: counted {counted:.3e} MACs, modelled {modelled:.3e}")
        assert abs(modelled / counted - 1) < 0.01, (n, counted, modelled)
    assert cost.unit_cost((1, 1, 1600)) > 2 * cost.unit_cost((1, 1, 800))
