"""Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet linear attention between full-attention layers) under CP.

The shared family tests (hf_families.FAMILIES) run qwen3.5-tiny in every mode; here: Qwen3.5-MoE
with its router loss at CP 2 and 4 (mixed, packed, a rank without images, text-only), the naive
CP that this integration rules out, the unchanged model's float32 delta rule, and the layer swap.

Reference: the model's own one-process forward and backward (each packed document alone: with
per-document positions the model's linear layers still scan across documents), with its float32 islands read
in float64 in both runs (the kit's ``float64_islands``: transformers' delta rule, decay,
``Qwen3_5RMSNorm`` and the gated output norm, their own code with the float32 casts read as
float64; a float32 op left there makes the result depend on the CPU's kernels, see
``test_float64_islands_leave_no_float32_in_linear_attention``). float64 tolerance
1e-10: measured <= 2e-13 (the decay parameters, A_log and dt_bias, whose gradients are sums of
cancelling terms), every other gradient <= 2e-15.
"""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_families import cached_model, float64_islands  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (  # noqa: E402
    Qwen3_5MoeGatedDeltaNet,
)

from cpvlm.families.qwen3_5 import (  # noqa: E402
    ContextParallelQwen3_5GatedDeltaNet,
    tiny_qwen3_5_moe_config,
)
from cpvlm.hf import (  # noqa: E402
    ContextParallelVLM,
    SampleSpec,
    adapter_for,
    synthetic_batch,
)
from cpvlm.options import CPOptions  # noqa: E402
from cpvlm.verify import (  # noqa: E402
    cp_loss_and_grads,
    gradient_errors,
    mixed_batch,
    packed_documents,
    reference,
    rel_err,
    run_distributed,
)

COEF = 0.5  # the router loss weight: large enough to move every gradient well above 1e-10
SCALABLE, COMPAT = ("ring", "route", "scalable"), ("allgather", "allgather", "compat")
TIMEOUT = 600  # s; seconds on an idle 2-core machine, minutes when it is shared
_models = {}


def moe_model():
    """Qwen3.5-MoE tiny in float64, router weights drawn with std 0.3 (at the initializer's 0.02
    every expert probability is ~1/E and top-2 choices are near ties), float64 islands."""
    if "moe" not in _models:
        config = tiny_qwen3_5_moe_config(text_config={"router_aux_loss_coef": COEF})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForImageTextToText.from_config(config, experts_implementation="eager")
            for layer in model.model.language_model.layers:
                torch.nn.init.normal_(layer.mlp.gate.weight, std=0.3)
        model = model.to(torch.float64).train()
        float64_islands(model)
        _models["moe"] = model
    return _models["moe"]


def _model(name, islands=True):
    return moe_model() if name == "moe" else cached_model(name, islands=islands)


def _batch(model, kind):
    """``(batch, doc_lens)``: images, a video and a text-only row; packed documents; one small
    image up front (at cp 4 three ranks encode nothing and two hold no visual token); text only."""
    if kind == "packed":
        packed, _, doc_lens = packed_documents(model, torch.float64)
        return packed, doc_lens
    if kind == "mixed":
        return mixed_batch(model, torch.float64), None
    specs = {
        "single": [SampleSpec(images=((4, 4),), text_len=60)],
        "text": [SampleSpec(text_len=23), SampleSpec(text_len=17)],
    }[kind]
    batch = synthetic_batch(model.config, specs, dtype=torch.float64, seed=2)
    if kind == "text":
        batch.pop("mm_token_type_ids")
    return batch, None


def _cp(rank, world_size, name, cases, islands=True, naive=False):
    """Every (kind, config) on this rank; rank 0 returns the summed losses and gradients."""
    base = _model(name, islands)
    results = []
    for kind, (attn, vision, flow) in cases:
        batch, doc_lens = _batch(base, kind)
        model = copy.deepcopy(base)
        cp_model = ContextParallelVLM(
            model, dist.group.WORLD, options=CPOptions(attn=attn, vision=vision, flow=flow)
        )
        if naive:  # each rank's linear layers on its own shard, from zero states
            for module in model.modules():
                if isinstance(module, ContextParallelQwen3_5GatedDeltaNet):
                    module.__class__ = Qwen3_5GatedDeltaNet
        out, loss, grads = cp_loss_and_grads(cp_model, batch, doc_lens)
        results.append(
            {"loss": loss, "grads": grads if rank == 0 else None, "units": out.encoded_units}
        )
    return results


def _reference(name, kind, islands=True):
    model = _model(name, islands)
    return reference(model, *_batch(model, kind))


def _errors(result, ref_loss, ref_grads):
    grads = gradient_errors(result["grads"], ref_grads, ())  # no zero_gradients: every one relative
    return rel_err(result["loss"], ref_loss), grads


def _router_gap(model, batch) -> float:
    """The smallest distance of a top-2 choice from a tie, over the batch's tokens and layers."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        out = model(**inputs, use_cache=False, output_router_logits=True)
    model.model.rope_deltas = None
    probs = [torch.softmax(t, -1).sort(-1, descending=True).values for t in out.router_logits]
    return min(float((p[:, 1] - p[:, 2]).min()) for p in probs)


# cp 2: both flows on the mixed batch, then packed, single-image and text-only; cp 4: the packed
# documents (chunks shorter than the conv kernel) and the single image (three ranks encode nothing).
MOE_CASES = {
    2: [("mixed", SCALABLE), ("mixed", COMPAT), ("packed", SCALABLE), ("single", COMPAT)]
    + [("text", SCALABLE)],
    4: [("packed", SCALABLE), ("single", SCALABLE)],
}


# cp 2 (every kind of batch) also under a second ATen kernel family (-m float64_family).
@pytest.mark.parametrize("cp", [pytest.param(2, marks=pytest.mark.float64_family), 4])
def test_moe_loss_and_every_gradient_match_one_process_float64(cp):
    cases = MOE_CASES[cp]
    model = moe_model()
    # No top-2 choice near a tie in any case (each packed document alone): measured >= 4.3e-5.
    batches = [_batch(model, k)[0] for k in ("mixed", "single", "text")]
    batches += packed_documents(model, torch.float64)[1]
    assert min(_router_gap(model, b) for b in batches) > 1e-6
    per_rank = run_distributed(_cp, cp, "moe", cases, timeout=TIMEOUT)
    refs = {kind: _reference("moe", kind) for kind in {k for k, _ in cases}}
    for i, (kind, config) in enumerate(cases):
        ref_loss, ref_grads = refs[kind]
        routers = [n for n in ref_grads if ".mlp.gate." in n]
        linear = [n for n in ref_grads if ".linear_attn." in n]
        assert len(routers) == 2 and len(linear) == 9
        assert all(ref_grads[n].abs().max() > 0 for n in routers + linear)
        loss_err, grad_errs = _errors(per_rank[0][i], ref_loss, ref_grads)
        assert loss_err <= 1e-10, (kind, config, loss_err)
        for n, err in grad_errs.items():
            assert err <= 1e-10, (kind, config, n, err)
    if cp == 4:
        single = cases.index(("single", SCALABLE))
        assert [r[single]["units"] for r in per_rank].count(0) == 3


LINEAR_LAYERS = (Qwen3_5GatedDeltaNet, Qwen3_5MoeGatedDeltaNet)


class _Float32Ops(TorchDispatchMode):
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


@pytest.mark.parametrize("name", ["qwen3.5-tiny", "moe"])
def test_float64_islands_leave_no_float32_in_linear_attention(name):
    """With ``float64_islands`` a float64 Gated DeltaNet layer (projections, conv, decay, delta
    rule, gated output norm), forward and backward, computes nothing in float32. A float32 op left
    there makes the exactness tests depend on the CPU: ATen's AVX2 and AVX-512 kernels compute a
    tensor's last elements (fewer than two vector widths) with the scalar formula, which differs
    from the vectorised one in the last float32 bit for ~4% of inputs (``silu``, ``sigmoid``), and a
    CP shard ends elsewhere than the one-process run's tensor. Measured with the gated norm's
    float32 ``silu`` (linear value head dim 10, seed 2, packed, cp 2): conv1d.weight 4.7e-10 and
    in_proj_qkv.weight 8.9e-10 under avx2, 4e-16 under ``ATEN_CPU_CAPABILITY=default``; on an
    AVX-512 machine the tiny model itself (48 gate values a token, a 32-element step) put
    conv1d.weight at 4.07e-10."""
    model = _model(name)
    layer = next(m for m in model.modules() if isinstance(m, LINEAR_LAYERS))
    x = torch.randn(2, 37, model.config.text_config.hidden_size, dtype=torch.float64)
    x.requires_grad_(True)
    with _Float32Ops() as seen:
        layer(x).square().sum().backward()
    model.zero_grad(set_to_none=True)
    assert not seen.ops, sorted(seen.ops)


def test_naive_cp_linear_attention_fails_the_same_check():
    """Each rank running transformers' Gated DeltaNet on its own shard (zero conv history, zero
    initial state, what sharding the sequence alone gives) is far from the one-process model."""
    ref_loss, ref_grads = _reference("qwen3.5-tiny", "mixed")
    (result,) = run_distributed(
        _cp, 2, "qwen3.5-tiny", [("mixed", SCALABLE)], True, True, timeout=TIMEOUT
    )[0]
    loss_err, grad_errs = _errors(result, ref_loss, ref_grads)
    assert loss_err > 1e-4, loss_err
    linear = {n: e for n, e in grad_errs.items() if ".linear_attn." in n}
    assert len(linear) == 9 and min(linear.values()) > 1e-3, linear


def test_unchanged_model_differs_by_its_float32_delta_rule_only():
    """Without the float64 islands the model's own forward runs transformers' torch delta rule in
    float32 (the decay too, and RMSNorm's weight sums), while CP runs it in float64: the CP
    gradients stay within float32 round-off amplified by the recurrence. Measured: loss 3e-10,
    linear-attention gradients <= 6e-6, every other gradient <= 3e-7."""
    ref_loss, ref_grads = _reference("qwen3.5-tiny", "mixed", islands=False)
    (result,) = run_distributed(
        _cp, 2, "qwen3.5-tiny", [("mixed", SCALABLE)], False, timeout=TIMEOUT
    )[0]
    loss_err, grad_errs = _errors(result, ref_loss, ref_grads)
    assert loss_err <= 1e-8
    assert max(grad_errs.values()) <= 5e-5, max(grad_errs.items(), key=lambda x: x[1])


def test_linear_attention_layers_become_cp_aware_in_place():
    """The swap keeps the module objects, parameter names and the model's own forward (without the
    CP context), and is idempotent."""
    model = copy.deepcopy(cached_model("qwen3.5-tiny", islands=False))
    batch = mixed_batch(model, torch.float64)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        before = model(**inputs, use_cache=False).logits
        model.model.rope_deltas = None
        keys, modules = list(model.state_dict()), list(model.modules())
        adapter = adapter_for(model)
        adapter.install_context_parallel(model)
        adapter.install_context_parallel(model)
        after = model(**inputs, use_cache=False).logits
        model.model.rope_deltas = None
    assert list(model.state_dict()) == keys and list(model.modules()) == modules
    swapped = [m for m in modules if isinstance(m, Qwen3_5GatedDeltaNet)]
    assert swapped and all(type(m) is ContextParallelQwen3_5GatedDeltaNet for m in swapped)
    assert torch.equal(after, before)
