"""Expert and tensor parallelism, modelled: bytes sent, memory and step time of a (dp, cp, ep, tp).

Legend: n tokens of a rank's CP shard, D hidden size, E experts (K per token), P the EP size, T
the TP size, L_moe MoE layers, L decoder layers.

What cpvlm sends (``cpvlm.parallelize.expert_parallel``): per MoE layer and rank, the n K (token,
expert) pairs travel to their experts' ranks (dispatch) and back (combine), rows of D in the
compute dtype; the backward is the same two exchanges transposed, and activation checkpointing
runs the forward's two once more. The lower bound for that layout is the pairs whose expert is on
another rank: (P - 1) / P of them under uniform routing; cpvlm's exchange sends exactly those (a
pair to its own rank is a local copy), plus one all-to-all of P x E / P int64 counts per layer.
TP (``cpvlm.parallelize.tensor_parallel``, torch's Colwise/RowwiseParallel, no sequence
parallelism): every rowwise projection all-reduces its [n, D] output in the forward, every
colwise projection its input's gradient in the backward, one all-reduce each (torch does not fuse
q/k/v or gate/up); the lower bound is Megatron's layer, one all-reduce per block and direction (a
sequence-parallel reduce-scatter + all-gather moves the same bytes), a ring all-reduce of B bytes
sending 2 (T - 1) / T B per rank.

Not simulated: ``cpvlm plan`` simulates the ep = tp = 1 rank on fake tensors and ``modelled_memory``
moves the bytes EP and TP change (labelled "modelled" wherever shown).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GPUS_PER_NODE = 8
NVLINK_BYTES_PER_S = 200e9  # achieved all-to-all per H100 (cpvlm.attention.cost.CUDA_NCCL)
IB_BYTES_PER_S = 50e9  # one 400 Gb/s NDR InfiniBand link per H100 (DGX H100), nominal
MESSAGE_S = 20e-6  # per message (cpvlm.attention.cost.CUDA_NCCL)
HOST_SYNC_S = 50e-6  # a device-to-host read of the split sizes (.tolist()): stalls the stream
MASTER_BYTES = 16  # float32 parameter, gradient and two AdamW states


@dataclass(frozen=True)
class ModelFacts:
    """What the EP/TP model needs from a config (counted on the meta device)."""

    hidden: int
    layers: int
    moe_layers: int
    experts: int  # 0: dense
    top_k: int
    heads: int
    kv_heads: int
    params: int  # every parameter (embeddings excluded)
    expert_params: int  # the fused experts' parameters, all MoE layers
    tp_params: int  # the parameters the TP plan splits, all layers
    colwise: int  # colwise projections, all layers (all-reduce of the input's gradient)
    rowwise: int  # rowwise projections, all layers (all-reduce of the output)
    tp_blocks: int  # blocks with split projections (attention, dense MLP), all layers
    tp_error: str | None  # why cpvlm refuses TP for this model, if it does

    @property
    def active_params(self) -> int:
        """Parameters a token multiplies: the experts' at K / E."""
        if not self.experts:
            return self.params
        return self.params - self.expert_params + self.expert_params * self.top_k // self.experts


_FACTS: dict[int, tuple] = {}  # id(config) -> (config, its facts): the config kept, its id unique


def model_facts(config) -> ModelFacts:
    cached = _FACTS.get(id(config))
    if cached is not None and cached[0] is config:
        return cached[1]
    from cpvlm.parallelize.expert_parallel import expert_modules
    from cpvlm.parallelize.tensor_parallel import decoder_layer_plan
    from cpvlm.simulate.depth import meta_model

    text = config.text_config
    model = meta_model(config, torch.float32)
    experts = expert_modules(model)
    expert_params = sum(p.numel() for m in experts for p in m.parameters(recurse=False))
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    try:
        plan, tp_error = decoder_layer_plan(getattr(text, "base_model_tp_plan", None)), None
    except ValueError as err:
        plan, tp_error = {}, str(err).splitlines()[0]
    # the plan's projections that each decoder layer has (a MoE layer has no dense MLP)
    split, tp_params = {}, 0  # split: decoder layer index -> {path: style}
    for n, p in model.named_parameters():
        prefix, _, rest = n.partition(".layers.")
        index, _, path = rest.partition(".")
        path = path.removesuffix(".weight")
        if "language_model" in prefix and n.endswith(".weight") and path in plan:
            split.setdefault(index, {})[path] = plan[path]
            tp_params += p.numel()
    styles = [s for layer in split.values() for s in layer.values()]
    blocks = sum(len({p.split(".")[0] for p in layer}) for layer in split.values())
    facts = ModelFacts(
        hidden=text.hidden_size,
        layers=text.num_hidden_layers,
        moe_layers=len(experts),
        experts=experts[0].num_experts if experts else 0,
        top_k=getattr(text, "num_experts_per_tok", 0) if experts else 0,
        heads=text.num_attention_heads,
        kv_heads=text.num_key_value_heads,
        params=params,
        expert_params=expert_params,
        tp_params=tp_params if tp_error is None else 0,
        colwise=styles.count("colwise"),
        rowwise=styles.count("rowwise"),
        tp_blocks=blocks,
        tp_error=tp_error,
    )
    _FACTS[id(config)] = (config, facts)
    return facts


def ep_bytes(facts: ModelFacts, tokens: int, ep: int, checkpointing: bool, dtype_bytes=2) -> dict:
    """Bytes one rank sends to other ranks per step for EP (uniform routing): cpvlm's exchange and
    the layout's lower bound, with the exchanges and host syncs counted."""
    if ep == 1 or not facts.experts:
        return {"sent": 0, "bound": 0, "counts": 0, "exchanges": 0, "host_syncs": 0}
    passes = 6 if checkpointing else 4  # dispatch + combine: forward, (recompute,) backward
    pair_rows = tokens * facts.top_k * (ep - 1) / ep
    per_pass = pair_rows * facts.hidden * dtype_bytes
    counts = (facts.moe_layers * (passes // 2)) * (ep - 1) / ep * facts.experts * 8
    return {
        "sent": facts.moe_layers * passes * per_pass + counts,
        "bound": facts.moe_layers * passes * per_pass,
        "counts": counts,
        "exchanges": facts.moe_layers * (passes + passes // 2),
        # the split sizes are read on the host once per dispatch (forward and recompute)
        "host_syncs": facts.moe_layers * (passes // 2 - 1),
    }


def tp_bytes(facts: ModelFacts, tokens: int, tp: int, checkpointing: bool, dtype_bytes=2) -> dict:
    """Bytes one rank sends per step for TP's all-reduces of [n, D] (ring: 2 (T-1)/T of them):
    cpvlm's (one per rowwise projection forward, per colwise one backward) and Megatron's bound
    (one per attention and MLP block each way)."""
    if tp == 1 or facts.tp_error:
        return {"sent": 0, "bound": 0, "all_reduces": 0}
    ring = 2 * (tp - 1) / tp * tokens * facts.hidden * dtype_bytes
    forwards = 2 if checkpointing else 1
    ours = forwards * facts.rowwise + facts.colwise
    bound = (forwards + 1) * facts.tp_blocks
    return {"sent": ours * ring, "bound": bound * ring, "all_reduces": ours}


def _link_seconds(nbytes: float, group: int, span: int) -> float:
    """Seconds to send ``nbytes`` spread evenly over ``group - 1`` peers, the group's ranks
    ``span`` GPUs apart (1: neighbours): NVLink inside a node, InfiniBand to other nodes."""
    if group == 1 or nbytes == 0:
        return 0.0
    in_node = max(1, min(group, GPUS_PER_NODE // span))
    off = (group - in_node) / (group - 1)
    return max(nbytes * (1 - off) / NVLINK_BYTES_PER_S, nbytes * off / IB_BYTES_PER_S)


def comm_seconds(facts, tokens, world, ep, tp, checkpointing) -> dict:
    """Seconds of EP and TP communication on one rank, all exposed (the experts wait for the
    dispatch, the next projection for the all-reduce), and of FSDP2's (``fsdp_seconds``, before
    overlap). Ranks: tp innermost, then cp, then dp; an EP group is ep consecutive ranks of dp x
    cp, so its ranks are tp GPUs apart."""
    e, t = ep_bytes(facts, tokens, ep, checkpointing), tp_bytes(facts, tokens, tp, checkpointing)
    ep_s = _link_seconds(e["sent"], ep, tp) + e["exchanges"] * (ep - 1) * MESSAGE_S
    ep_s += e["host_syncs"] * HOST_SYNC_S
    tp_s = _link_seconds(t["sent"], tp, 1) + t["all_reduces"] * 2 * (tp - 1) * MESSAGE_S
    return {"ep_s": ep_s, "tp_s": tp_s, "fsdp_s": fsdp_seconds(facts, world, ep, tp)}


def fsdp_seconds(facts: ModelFacts, world: int, ep: int, tp: int, master_bytes: int = 4) -> float:
    """Seconds of FSDP2's traffic on one rank per step, before any overlap: each parameter
    all-gathered in bf16 twice (forward; backward, which the recompute shares) and its gradient
    reduce-scattered in ``master_bytes``: over the ``world`` = dp x cp ranks of a tp rank; the
    TP-split projections 1 / tp of theirs. Under EP the experts are their own FSDP2 units: this
    rank's 1 / ep of them over their world / ep replicas (ranks tp x ep GPUs apart; none at
    ep = world)."""
    per_param = 2 * 2 + master_bytes
    experts = facts.expert_params if ep > 1 else 0
    dense = facts.params - facts.tp_params * (1 - 1 / tp) - experts
    seconds = _link_seconds(per_param * dense * (world - 1) / world, world, tp)
    replicas = world // ep
    if experts and replicas > 1:
        held = per_param * experts / ep * (replicas - 1) / replicas
        seconds += _link_seconds(held, replicas, tp * ep)
    return seconds


def modelled_memory(memory, facts: ModelFacts, world: int, ep: int, tp: int, tokens: int) -> dict:
    """The per-rank bytes of (ep, tp) from a simulated ep = tp = 1 rank of ``world`` = dp x cp
    ranks (FSDP2 over them): the experts' master bytes stay 1 / world (EP holds 1 / ep of them,
    FSDP2 shards those over their world / ep replicas), their gathered bf16 layer goes to 1 / ep
    (a rank gathers only its own experts); the TP-split layers' master and gathered bytes / tp; the transient activations of a layer
    (beyond what it saves) / tp; plus one MoE layer's dispatch buffers (received pairs, the
    experts' output, what comes back, the pairs in token order: 4 n K D bf16)."""
    fixed = memory.params + memory.grads + memory.optimizer
    tp_fixed = -MASTER_BYTES * facts.tp_params / world * (1 - 1 / tp)
    layer_experts = 2 * facts.expert_params / max(1, facts.moe_layers)
    gathered = -min(memory.gathered, layer_experts) * (1 - 1 / ep)
    gathered -= min(memory.gathered, 2 * facts.tp_params / facts.layers) * (1 - 1 / tp)
    transient = max(0, memory.peak_activations - memory.saved_activations) * (1 - 1 / tp)
    buffers = 4 * tokens * facts.top_k * facts.hidden * 2 if ep > 1 else 0
    peak = memory.steady_peak + tp_fixed + gathered - transient + buffers
    return {
        "weights": fixed + tp_fixed,
        "peak": peak,
        "tp_weights_delta": tp_fixed,
        "gathered_delta": gathered,
        "transient_delta": -transient,
        "dispatch_buffers": buffers,
    }
