"""EP and TP communication per rank and step: cpvlm's bytes against the lower bound, step time.

    python benchmarks/ep_tp_comm.py            # the modelled grid and the gloo measurement
    python benchmarks/ep_tp_comm.py --no-measure

Modelled (``cpvlm.simulate.parallel_cost``; published configs, text rows of 128k tokens, bf16
compute, activation checkpointing): per rank and step, the bytes sent to other ranks by EP's
dispatch + combine (forward, recompute, backward; uniform routing) against the pairs whose expert
is on another rank, and by TP's all-reduces (cpvlm: one per rowwise projection forward, per
colwise one backward; no sequence parallelism) against Megatron's one per block and direction,
both ring all-reduces; then the step's modelled seconds (``cpvlm.simulate.plan.step_parts``:
attention from cpvlm's cost model, matmuls at 364 TFLOP/s, NVLink 200 GB/s inside a node of 8,
InfiniBand 50 GB/s per GPU across, 20 us a message, 50 us a host sync; FSDP2's all-gathers and
reduce-scatters, the experts' over their replicas under EP, counted where the compute cannot
hide them).
Measured (gloo, CPU, 2 and 4 processes): the bytes cpvlm's own EP exchange sends on a toy experts
module (uniform random routing) and the all-reduces torch's TP makes in the tiny Qwen2.5-VL's
decoder layers, each against the model above at the same sizes.
Writes benchmarks/results/ep_tp_comm.json.
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import Clock, parser, print_table, write_json  # noqa: E402

SEQ = 131072
GB = 1e9
# (model, dp, cp, ep, tp): GPUs = dp x cp x tp; EP groups borrow dp x cp ranks
GRID = [
    ("qwen3-omni-30b-a3b", 1, 8, 1, 1),
    ("qwen3-omni-30b-a3b", 1, 8, 8, 1),
    ("qwen3-omni-30b-a3b", 1, 4, 4, 2),
    ("nemotron-3-nano-omni-30b-a3b", 1, 8, 1, 1),
    ("nemotron-3-nano-omni-30b-a3b", 1, 8, 8, 1),
    ("nemotron-3-nano-omni-30b-a3b", 1, 4, 4, 2),
    ("qwen3-vl-235b-a22b", 1, 32, 1, 1),
    ("qwen3-vl-235b-a22b", 1, 32, 8, 1),
    ("qwen3-vl-235b-a22b", 1, 32, 32, 1),
    ("qwen3-vl-235b-a22b", 1, 128, 1, 1),
    ("qwen3-vl-235b-a22b", 1, 128, 128, 1),
    ("qwen3-vl-235b-a22b", 4, 32, 8, 1),
    ("qwen3-vl-235b-a22b", 1, 16, 16, 2),
    ("qwen3-vl-235b-a22b", 1, 8, 8, 4),
    ("qwen2.5-vl-72b", 1, 8, 1, 1),
    ("qwen2.5-vl-72b", 1, 4, 1, 2),
    ("qwen2.5-vl-72b", 1, 1, 1, 8),
    ("qwen2.5-vl-72b", 1, 32, 1, 1),
    ("qwen2.5-vl-72b", 1, 8, 1, 4),
]
COLS = [
    "model",
    "dp",
    "cp",
    "ep",
    "tp",
    "tokens",
    "ep_GB",
    "ep_bound_GB",
    "ep_ratio",
    "tp_GB",
    "tp_bound_GB",
    "tp_ratio",
    "compute_s",
    "ep_s",
    "tp_s",
    "fsdp_s",
    "step_s",
    "comm_%",
    "host_syncs",
]


def modelled_rows() -> list[dict]:
    from cpvlm.simulate import SequenceSpec, Setup, load_config
    from cpvlm.simulate.parallel_cost import ep_bytes, model_facts, tp_bytes
    from cpvlm.simulate.plan import step_parts

    rows, configs = [], {}
    for model, dp, cp, ep, tp in GRID:
        config = configs.setdefault(model, load_config(model))
        facts = model_facts(config)
        tokens = SEQ // cp
        e, t = ep_bytes(facts, tokens, ep, True), tp_bytes(facts, tokens, tp, True)
        setup = Setup(dp=dp, cp=cp, activation_checkpointing=True)
        parts = step_parts(config, SequenceSpec(SEQ), setup, ep, tp)
        compute = parts["attention_s"] + parts["matmul_s"]
        step = sum(parts.values())
        rows.append(
            {
                "model": model,
                "dp": dp,
                "cp": cp,
                "ep": ep,
                "tp": tp,
                "gpus": dp * cp * tp,
                "tokens": tokens,
                "ep_GB": e["sent"] / GB,
                "ep_bound_GB": e["bound"] / GB,
                "ep_ratio": e["sent"] / e["bound"] if e["bound"] else None,
                "tp_GB": t["sent"] / GB,
                "tp_bound_GB": t["bound"] / GB,
                "tp_ratio": t["sent"] / t["bound"] if t["bound"] else None,
                "compute_s": compute,
                "ep_s": parts["ep_s"],
                "tp_s": parts["tp_s"],
                "fsdp_s": parts["fsdp_exposed_s"],
                "step_s": step,
                "comm_%": 100 * (step - compute) / step,
                "host_syncs": e["host_syncs"],
                "tp_all_reduces": t["all_reduces"],
                "ep_exchanges": e["exchanges"],
            }
        )
    return rows


# Per-rank memory at EP/TP (the scale table's rows): (model, seq, dp, cp, ep, tp) on 80 GB GPUs,
# the ep = tp = 1 rank of dp x cp simulated, EP/TP modelled on it; and the published points.
MEMORY_GRID = [
    ("qwen3-vl-235b-a22b", 131072, 4, 32, 8, 1),
    ("qwen3-vl-235b-a22b", 131072, 4, 32, 32, 1),
    ("qwen3-vl-235b-a22b", 131072, 1, 128, 128, 1),
    ("qwen3-vl-235b-a22b", 131072, 1, 64, 64, 2),
    ("qwen2.5-vl-72b", 131072, 1, 32, 1, 1),
    ("qwen2.5-vl-72b", 131072, 1, 16, 1, 2),
    ("qwen2.5-vl-72b", 131072, 1, 8, 1, 4),
    # Automodel's published point (EP 8 x CP 32, dp 4); beside it FSDP2 alone and ep = dp x cp
    ("qwen3.5-122b-a10b", 131072, 4, 32, 1, 1),
    ("qwen3.5-122b-a10b", 131072, 4, 32, 8, 1),
    ("qwen3.5-122b-a10b", 131072, 4, 32, 128, 1),
    # TRL's published point's sizes: 1M tokens, CP 8 on one node (Qwen3-VL-8B's decoder is Qwen3-8B's)
    ("qwen3-vl-8b", 1048576, 1, 8, 1, 1),
]
PUBLISHED = [
    {
        "who": "NeMo Automodel",
        "model": "Qwen3.5-122B-A10B (vision-heavy MedPix packs)",
        "seq": 131072,
        "gpus": 128,
        "layout": "CP 32 x DP 4 (FSDP2), EP 8 over them (experts FSDP-sharded over the other 16), "
        "16 x 8 H100",
        "peak": "60.55 GiB: rank 0's torch.cuda.max_memory_allocated as the recipe logs it",
        "settings": "full activation checkpointing; bf16 parameters and compute, TE FusedAdam with "
        "fp32 master weights (stored as 16-bit remainders) and fp32 moments; "
        "FusedLinearCrossEntropy; SDPA; torch_mm experts, HybridEP dispatch; trainable tower, "
        "frames sharded over CP; one 128K pack per CP group (global batch 4)",
        "source": "NVIDIA-NeMo/Automodel PR #3186, comment of 2026-07-24 (exact head dd4c77769e55, "
        "CI job 372189477: 'peak reported memory was 60.55 GiB'); recipe "
        "examples/vlm_finetune/qwen3_5_moe/qwen3_5_122b_128k_ep8cp32.yaml at fb0a7ed79a29",
    },
    {
        "who": "TRL",
        "model": "Qwen3-8B (text)",
        "seq": 1048576,
        "gpus": 8,
        "layout": "CP 8 (ring) under FSDP2 (accelerate), one 8 x H100 node",
        "peak": "56.2 GB per GPU (which statistic, and GB or GiB, not stated)",
        "settings": "gradient checkpointing with offload (each checkpointed layer's input in "
        "pinned host memory); chunked_nll loss (the default); model in bfloat16, accelerate "
        "mixed_precision bf16; YaRN x32 RoPE; batch 1, no packing; 380 s/step",
        "source": "huggingface/trl PR #6846 ('Qwen3-8B at 1,048,576 tokens: 380 s/step, 56.2 GB "
        "per GPU') and the v1.13.0 release notes; examples/sft_qwen3_8b_1m_context/ and "
        "docs/source/long_context_training.md",
    },
]


def memory_rows() -> list[dict]:
    from cpvlm.simulate import SequenceSpec, Setup, load_config, simulate_step
    from cpvlm.simulate.parallel_cost import model_facts, modelled_memory
    from cpvlm.simulate.plan import step_seconds

    G, budget = 2**30, 80e9
    rows, configs, cache, simulated = [], {}, {}, {}
    for model, seq, dp, cp, ep, tp in MEMORY_GRID:
        config = configs.setdefault(model, load_config(model))
        setup = Setup(dp=dp, cp=cp, activation_checkpointing=True, loss_chunk=1024)
        clock = Clock()
        key = (model, seq, dp, cp)  # one simulation per rank; ep and tp are modelled on it
        if key not in simulated:
            simulated[key] = simulate_step(
                config, SequenceSpec(seq), setup, cache.setdefault(model, {})
            )
        memory = simulated[key]
        m = modelled_memory(memory, model_facts(config), dp * cp, ep, tp, memory.local_len)
        rows.append(
            {
                "model": model,
                "seq": seq,
                "gpus": dp * cp * tp,
                "dp": dp,
                "cp": cp,
                "ep": ep,
                "tp": tp,
                "simulated_peak_GiB": memory.steady_peak / G,
                "modelled_peak_GiB": m["peak"] / G,
                "weights_GiB": m["weights"] / G,
                "fits": m["peak"] <= budget,
                "step_s": step_seconds(config, SequenceSpec(seq), setup, ep, tp),
                "sim_cpu_s": clock.cpu(),
                **{k: v / G for k, v in m.items() if k not in ("peak", "weights")},
            }
        )
        print_table(rows[-1:], MEMORY_COLS)
    return rows


MEMORY_COLS = [
    "model",
    "gpus",
    "dp",
    "cp",
    "ep",
    "tp",
    "simulated_peak_GiB",
    "modelled_peak_GiB",
    "weights_GiB",
    "fits",
    "step_s",
    "sim_cpu_s",
]


# ---- measured on gloo ----

DIM, EXPERTS, TOP_K, TOKENS = 64, 8, 2, 512


class _ToyExperts(torch.nn.Module):
    """The fused-experts contract (``cpvlm.parallelize.expert_parallel``), one matmul each."""

    def __init__(self):
        super().__init__()
        self.num_experts = EXPERTS
        g = torch.Generator().manual_seed(0)
        self.proj = torch.nn.Parameter(torch.randn(EXPERTS, DIM, DIM, generator=g))

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for k in range(top_k_index.shape[1]):
            h = torch.einsum("nd,nfd->nf", x, self.proj[top_k_index[:, k]])
            out = out + top_k_weights[:, k, None] * h
        return out


def _ep_rank(rank, world):
    from cpvlm.parallelize import build_mesh, mesh_groups, parallelize_experts

    groups = mesh_groups(build_mesh(dp_shard=1, cp=world, ep=world), ep=world)
    experts = _ToyExperts()
    parallelize_experts(experts, groups.ep_mesh["ep"])
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(TOKENS, DIM, generator=g, requires_grad=True)
    index = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    weights = torch.full((TOKENS, TOP_K), 1 / TOP_K)
    sent = {"rows_bytes": 0, "count_bytes": 0, "calls": 0}
    real = dist.all_to_all_single

    def counting(out, inp, out_splits=None, in_splits=None, group=None, **kw):
        me = dist.get_rank(group)
        if in_splits is None:  # the per-expert counts: equal blocks
            block = inp.numel() // dist.get_world_size(group)
            sent["count_bytes"] += (inp.numel() - block) * inp.element_size()
        else:
            row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
            sent["rows_bytes"] += sum(n for r, n in enumerate(in_splits) if r != me) * row
        sent["calls"] += 1
        return real(out, inp, out_splits, in_splits, group=group, **kw)

    with mock.patch.object(dist, "all_to_all_single", counting):
        experts(x, index, weights).sum().backward()
    own = (index // (EXPERTS // world) != rank).sum().item()  # pairs bound for other ranks
    return {**sent, "bound_bytes": 2 * 2 * own * DIM * x.element_size()}


def _tp_rank(rank, world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from cpvlm.hf import adapter_for, build_model
    from cpvlm.parallelize.tensor_parallel import parallelize_decoder_layers

    model = build_model("qwen2.5-vl-tiny", dtype=torch.float32, seed=0)
    text = model.config.get_text_config()
    layers = adapter_for(model).decoder_layers(model)
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("tp",))
    parallelize_decoder_layers(
        layers,
        text.base_model_tp_plan,
        mesh,
        num_heads=text.num_attention_heads,
        num_kv_heads=text.num_key_value_heads,
    )
    x = torch.randn(1, 16, text.hidden_size, requires_grad=True)
    position_ids = torch.arange(16)[None].expand(3, 1, 16)
    rotary = model.model.language_model.rotary_emb(x, position_ids)
    counts: dict[str, list[int]] = {}

    class Collectives(TorchDispatchMode):  # every c10d op torch's TP runs: count and bytes
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func).split(".")[1] in (
                "all_reduce",
                "reduce_scatter_tensor",
                "all_gather_into_tensor",
            ):
                t = args[0]
                seen = counts.setdefault(str(func), [0, 0])
                seen[0] += 1
                seen[1] += t.numel() * t.element_size()
            return func(*args, **(kwargs or {}))

    with Collectives():
        h = x
        for layer in layers:
            out = layer(h, position_embeddings=rotary)
            h = out[0] if isinstance(out, tuple) else out
        h.sum().backward()
    return {
        "layers": len(layers),
        "tokens": x.shape[1],
        "hidden": text.hidden_size,
        "ops": {k: {"calls": c, "bytes": b} for k, (c, b) in counts.items()},
    }


def measured() -> dict:
    from cpvlm.testing import run_distributed

    out = {"ep": [], "tp": []}
    for world in (2, 4):
        # a rank sends its own pairs (dispatch, combine's gradient) and its received ones back
        # (combine, dispatch's gradient): the ranks' mean is the bound 4 x own pairs
        ranks = run_distributed(_ep_rank, world)
        sent = sum(r["rows_bytes"] for r in ranks) / world
        bound = sum(r["bound_bytes"] for r in ranks) / world
        modelled = 2 * 2 * TOKENS * TOP_K * (world - 1) / world * DIM * 4
        out["ep"].append(
            {
                "ep": world,
                "rows_bytes_per_rank": sent,
                "bound_bytes_per_rank": bound,
                "modelled_uniform_bytes": modelled,
                "count_bytes_per_rank": sum(r["count_bytes"] for r in ranks) / world,
                "all_to_alls_per_rank": ranks[0]["calls"],
            }
        )
    from cpvlm.hf import TINY_MODELS
    from cpvlm.simulate.parallel_cost import model_facts, tp_bytes

    r = run_distributed(_tp_rank, 2)[0]
    facts = model_facts(TINY_MODELS["qwen2.5-vl-tiny"]())
    modelled = tp_bytes(facts, r["tokens"], 2, checkpointing=False, dtype_bytes=4)
    ring = 2 * (2 - 1) / 2
    out["tp"].append(
        {
            "tp": 2,
            **r,
            "all_reduces": sum(o["calls"] for o in r["ops"].values()),
            "sent_bytes": ring * sum(o["bytes"] for o in r["ops"].values()),
            "modelled_all_reduces": modelled["all_reduces"],
            "modelled_sent_bytes": modelled["sent"],
            "bound_bytes": modelled["bound"],
        }
    )
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--no-measure", action="store_true", help="no gloo measurement")
    p.add_argument("--no-memory", action="store_true", help="no simulated memory rows")
    args = p.parse_args()
    clock = Clock()
    rows = modelled_rows()
    print_table(rows, COLS, f"per rank and step, {SEQ} text tokens, modelled (GB = 1e9 bytes)")
    payload = {"seq_len": SEQ, "rows": rows, "published": PUBLISHED}
    if not args.no_memory:
        payload["memory"] = memory_rows()
    if not args.no_measure:
        payload["measured"] = measured()
        print_table(payload["measured"]["ep"], list(payload["measured"]["ep"][0]), "EP on gloo")
        print("TP on gloo (tiny Qwen2.5-VL, tp 2):", payload["measured"]["tp"])
    payload["wall_s"] = clock.wall()
    write_json(args.out_dir, "ep_tp_comm", payload)


if __name__ == "__main__":
    main()
