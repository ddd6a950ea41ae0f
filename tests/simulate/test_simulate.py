"""cpvlm.simulate: the simulated rank's bytes against a real CPU run, and ``cpvlm plan``'s errors.

The real run is measured by benchmarks/memory.py's live-tensor tracker on gloo ranks; the
simulation runs the same step on fake tensors in this process. Saved-for-backward bytes must be
equal (both count each storage once; a fake tensor has its real tensor's shape and dtype); the
peak within 5% (the issue's bound: MemTracker and the real tracker see the same ops, but the
real run's figure includes what the gloo collectives allocate and the fake group does not).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from cpvlm.cli import main as cli
from cpvlm.distributed import compat
from cpvlm.hf import TINY_MODELS
from cpvlm.simulate.batch import SequenceSpec
from cpvlm.simulate.depth import meta_model, shard_bytes
from cpvlm.simulate.rank import Setup, simulate_step
from cpvlm.testing import run_distributed
from cpvlm.testing.memory_check import real_step, simulated_step

SPEC = SequenceSpec(512, images=((64, 64),), videos=((4, 64, 64),), docs=2)


# Qwen2.5-VL: its videos' second_per_grid_ts (floats that get_rope_index reads as numbers) must
# stay real under the fake mode; Gemma 3 (images only): sliding windows and image spans, whose
# masks transformers would build dense.
SPECS = {
    "qwen3-vl-tiny": SPEC,
    "qwen2.5-vl-tiny": SPEC,
    "gemma3-tiny": SequenceSpec(512, images=((64, 64), (64, 64)), docs=2),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_simulated_rank_matches_real_run(name):
    loss_chunk = None
    config, spec = TINY_MODELS[name](), SPECS[name]
    cp = 2
    real = run_distributed(real_step, cp, config, spec, "ring", loss_chunk, timeout=600)
    for rank in range(cp):
        sim = simulated_step(config, spec, cp, rank, "ring", loss_chunk)
        assert sim["saved"] == real[rank]["saved"], (rank, sim, real[rank])
        assert abs(sim["peak"] - real[rank]["peak"]) <= 0.05 * real[rank]["peak"], (rank, sim, real)


def test_a_row_with_audio_clips():
    """``cpvlm plan --audios``: clips in seconds become mel frames (100 per second), dealt over
    the documents; the simulated rank that encodes a clip saves the audio encoder's activations
    besides what the same row without audio saves."""
    from cpvlm.hf import adapter_for
    from cpvlm.simulate.batch import build_batch

    # (the router loss off: it reads data-dependent counts; the published config's is off)
    config = TINY_MODELS["qwen3-omni-moe-tiny"](text_config={"output_router_logits": False})
    spec = SequenceSpec(512, images=((64, 64),), docs=2, audios=(1.3, 0.57))
    batch, doc_lens = build_batch(config, spec)
    adapter = adapter_for(config)
    assert batch["input_ids"].shape[1] == 512 and len(doc_lens) == 2
    assert batch["audio_lengths"].tolist() == [130, 57]
    rows = adapter.audio_rows(130) + adapter.audio_rows(57)
    assert int((batch["input_ids"] == adapter.audio_token_id).sum()) == rows
    assert "2 audio clips (1.87 s)" in spec.describe()
    setup = Setup(cp=2, rank=0, activation_checkpointing=False, optimizer=False)
    with_audio = simulate_step(config, spec, setup)
    without = simulate_step(config, replace(spec, audios=()), setup)
    assert with_audio.saved > without.saved


def test_published_nemotron_omni_has_its_audio_encoder():
    """``cpvlm plan --model nemotron-3-nano-omni-30b-a3b --audios 600``: the published config
    builds its Parakeet encoder and projector on the meta device (Parakeet-TDT-0.6B's 0.6 B
    parameters; 1024 -> 4096 -> 2688), and a 600 s clip becomes 60000 mel frames and the
    model's f(60001) = 7501 placeholders between <so_start> and <so_end>, costed by the
    encoder's model. (The whole simulated step on this config: docs/plan.md, minutes.)"""
    from cpvlm.hf import adapter_for
    from cpvlm.simulate.batch import build_batch
    from cpvlm.simulate.configs import load_config

    config = load_config("nemotron-3-nano-omni-30b-a3b")
    adapter = adapter_for(config)
    model = meta_model(config, torch.bfloat16)
    tower = sum(p.numel() for p in adapter.audio_tower(model).parameters())
    assert 0.55e9 < tower < 0.65e9, tower
    shapes = [tuple(p.shape) for p in model.embed_audio.parameters()]
    assert shapes == [(1024,), (4096, 1024), (2688, 4096)], shapes
    batch, _ = build_batch(config, SequenceSpec(16384, audios=(600.0,)))
    assert batch["audio_features"].shape == (60000, 128)
    ids = batch["input_ids"][0].tolist()
    start, end = ids.index(adapter.audio_start_token_id), ids.index(adapter.audio_end_token_id)
    assert ids[start + 1 : end] == [adapter.audio_token_id] * 7501 == [27] * 7501
    assert ids.count(adapter.audio_token_id) == adapter.audio_rows(60000) == 7501
    cost = adapter.audio_cost()
    assert cost.full_blocks == 24 and cost.unit_cost((1, 1, 60000)) > 2 * cost.unit_cost(
        (1, 1, 30000)
    )  # attention over the whole clip: more than linear in its length


def test_meta_parameters_become_fake_not_real():
    # Module.to_empty under the fake mode feeds meta tensors to empty_like: they must come out
    # fake (HostIntegers once ran them for real: an 8B rank allocated 17.7 GB).
    with torch.device("meta"):
        model = nn.Linear(4096, 4096)
    with compat.fake_tensor_mode(), compat.HostIntegers():
        model = model.to_empty(device="cpu")
        assert all(compat.is_fake(p) for p in model.parameters())
        assert compat.is_fake(torch.empty(4096, 4096))
        assert not compat.is_fake(torch.arange(3))  # integers stay real


@pytest.mark.timeout(900)  # four simulated steps: ~1.5 min on 2 quiet cores, minutes when loaded
def test_reduced_depth_and_optimizer_against_full_depth_and_hand_count():
    """Fewer layers simulated and the rest added (cpvlm.simulate.depth) against the full model,
    both as one rank of FSDP2 over cp 2 with AdamW, with activation checkpointing (as the scale
    table runs): the saved bytes, parameter, gradient and optimizer shards equal; the affine
    fit's forward + backward peak and its categories equal, "add"'s an upper bound; the
    optimizer state and step peak as counted by hand."""
    config = TINY_MODELS["qwen3-vl-tiny"](
        text_config={"num_hidden_layers": 6},
        vision_config={"depth": 5, "deepstack_visual_indexes": [1]},
    )  # three text layers and two vision blocks left out (cpvlm.simulate.depth)
    spec = SequenceSpec(160, images=((32, 32),), videos=((2, 32, 32),))
    setup = Setup(cp=2, compute_dtype=None)
    full = simulate_step(config, spec, replace(setup, reduced_depth=False))
    affine = simulate_step(config, spec, replace(setup, depth_fit="affine"))
    added = simulate_step(config, spec, replace(setup, depth_fit="add"))
    for reduced in (affine, added):
        for name in ("saved", "loss_saved", "saved_gathered", "params", "grads", "optimizer"):
            assert getattr(reduced, name) == getattr(full, name), (name, reduced, full)
    # Identical layers, a schedule that repeats per layer: here the peak is affine in the depth
    # to within 1% (the bound; 0.15% low; cpvlm.simulate.depth says where it is not).
    assert abs(affine.peak_fwd_bwd - full.peak_fwd_bwd) <= 0.01 * full.peak_fwd_bwd
    # "add" counts every left-out gradient whole at the peak: an upper bound, close.
    assert full.peak_fwd_bwd <= added.peak_fwd_bwd <= 1.15 * full.peak_fwd_bwd
    nbytes, elems, tensors = shard_bytes(meta_model(config, torch.float32), 2, fsdp=True)
    assert full.params == nbytes and full.grads == 4 * elems
    # AdamW: exp_avg and exp_avg_sq of the gradient shards and a float32 step per parameter;
    # foreach's step holds one temporary of the gradients' size (sqrt of exp_avg_sq).
    assert full.optimizer == 2 * full.grads + 4 * tensors
    # Beyond that count: what stays live after the backward (the loss, small per-layer tensors:
    # 9 KB of 3 MB here), 1% at most.
    hand = full.params + full.grads + full.optimizer + full.grads
    for m in (full, affine, added):
        assert hand <= m.peak_opt <= 1.01 * hand, (m.peak_opt, hand)


def test_plan_rejects_unknown_model(capsys):
    assert (
        cli(
            [
                "plan",
                "--model",
                "no-such-model",
                "--seq-len",
                "1024",
                "--gpus",
                "8",
                "--gpu-mem",
                "80",
            ]
        )
        == 2
    )
    assert "not a known config" in capsys.readouterr().err


def test_plan_rejects_cp_not_dividing_gpus(capsys):
    args = ["plan", "--model", "qwen3-vl-tiny", "--seq-len", "1024", "--gpus", "8"]
    assert cli([*args, "--gpu-mem", "80", "--cp", "3"]) == 2
    assert "must divide --gpus 8" in capsys.readouterr().err
