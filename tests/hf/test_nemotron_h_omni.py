"""Nemotron 3 Nano Omni (Mamba-2, attention and MoE blocks; a RADIO tower beside a projector) under CP.

The shared family tests (hf_families.FAMILIES) run nemotron-omni-tiny at cp 2 and 4 (mixed, packed,
a rank without images, text-only, float32); here: cp 3 in every attention and vision mode, the
naive CP that the Mamba-2 integration rules out, the unchanged model's float32 parts, the layer
swap, the float64 islands, the refused audio and video inputs, the router's distance from ties and
the tower's cost model.

Reference: the model's own one-process forward and backward (each packed document alone), its
float32 parts read in float64 in both runs (the kit's ``float64_islands``). float64 tolerance
1e-10: measured <= 2e-15 for the loss and every gradient (the key biases, zero in exact arithmetic,
against their group's scale).
"""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_families import cached_model, grad_errors  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer  # noqa: E402

from cpvlm.families.nemotron_h_omni import (  # noqa: E402
    ContextParallelNemotronHMamba2Mixer,
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
    DistributedTestError,
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
    norm, the RMSNorms' weight products, the router and the logits in float32, while CP computes
    the mixers in float64: the CP loss and gradients stay within float32 round-off amplified by
    the recurrence. Measured: loss 8.5e-9, every gradient <= 3e-7 (the routers')."""
    model = cached_model(NAME, islands=False)
    ref_loss, ref_grads = reference(model, *_batch(model, "mixed"))
    (result,) = run_distributed(_cp, 2, [("mixed", CONFIGS[0])], False, timeout=TIMEOUT)[0]
    loss_err, errs = _errors(result, ref_loss, ref_grads)
    worst = max(errs, key=errs.get)
    print(f"unchanged model: loss {loss_err:.1e}, worst {worst} {errs[worst]:.1e}")
    assert loss_err <= 1e-7 and errs[worst] <= 1e-5, (loss_err, worst, errs[worst])


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
    """Records every aten op that returns a floating tensor narrower than float64."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                self.ops.add(str(func))
        return out


def test_float64_islands_leave_no_float32_in_the_model():
    """With ``float64_islands`` the float64 model's own forward and backward (tower, projector,
    Mamba-2, attention, router and experts, logits) computes nothing in float32; without them it
    does (the islands are needed)."""
    batch = mixed_batch(cached_model(NAME), torch.float64)
    inputs = adapter_for(cached_model(NAME)).to_model_batch(
        {k: v for k, v in batch.items() if k != "labels"}
    )
    for islands in (True, False):
        model = cached_model(NAME, islands=islands)
        with _NarrowOps() as seen:
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


def test_audio_and_video_inputs_are_refused_by_name():
    model = cached_model(NAME)
    batch = mixed_batch(model, torch.float64)
    audio = {**batch, "input_features": torch.zeros(1, 16, 128)}
    with pytest.raises(ValueError, match=r"audio inputs \(input_features\) are not supported yet"):
        prepare_batch(model, audio, 2)
    with pytest.raises(ValueError, match="audio inputs"):
        adapter_for(model).to_model_batch(audio)
    with pytest.raises(ValueError, match="videos are not supported yet"):
        synthetic_batch(model.config, [SampleSpec(videos=((2, 4, 4),), text_len=4)])
    assert not adapter_for(model).takes_videos


def _cp_audio_step(rank, world_size, batch):
    model = copy.deepcopy(cached_model(NAME))
    ContextParallelVLM(model, dist.group.WORLD)(**batch)


def test_audio_inputs_raise_on_every_cp_rank():
    """The CP step takes the audio keys (the model's own) only to refuse them, on every rank."""
    batch = mixed_batch(cached_model(NAME), torch.float64)
    batch["input_features"] = torch.zeros(1, 16, 128, dtype=torch.float64)
    with pytest.raises(DistributedTestError, match=r"rank\(s\) \[0, 1\] raised") as info:
        run_distributed(_cp_audio_step, 2, batch, timeout=TIMEOUT)
    assert "audio inputs (input_features) are not supported yet" in str(info.value)


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
