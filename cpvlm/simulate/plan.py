"""``cpvlm plan``: which (cp, dp, attn, activation checkpointing, loss chunk) fit a GPU budget.

Each candidate is one simulated rank (``cpvlm.simulate.rank``); its step time is modelled with
cpvlm's cost model (``cpvlm.attention.cost``, published CUDA figures) for the attention, and the
matmuls of the dense layers at the same achieved throughput (FlashAttention-2's ~350 TFLOP/s on
an H100; 6 flops per parameter and token, 8 with activation checkpointing).
"""

from __future__ import annotations

from dataclasses import dataclass

from cpvlm.simulate.batch import SequenceSpec
from cpvlm.simulate.rank import GiB, RankMemory, Setup, simulate_step

# The cost model's CUDA figure: 4 flops per (pair x head x D) in 1.1e-14 s.
ACHIEVED_FLOPS = 4 / 1.1e-14


@dataclass
class Candidate:
    setup: Setup
    memory: RankMemory | None
    error: str | None = None
    step_s: float | None = None
    longest: int | None = None  # the longest sequence that fits (linear in the activations)
    ep: int = 1
    tp: int = 1
    modelled: dict | None = None  # ep or tp > 1: parallel_cost.modelled_memory of ``memory``

    @property
    def peak(self) -> int | None:
        if self.memory is None or self.error is not None:
            return None
        return self.memory.steady_peak if self.modelled is None else self.modelled["peak"]

    def fits(self, budget: int) -> bool:
        return self.peak is not None and self.peak <= budget

    def as_dict(self) -> dict:
        s = self.setup
        return {
            "cp": s.cp,
            "dp": s.dp,
            "ep": self.ep,
            "tp": self.tp,
            "attn": s.attn,
            "activation_checkpointing": s.activation_checkpointing,
            "loss_chunk": s.loss_chunk,
            "memory": None if self.memory is None else self.memory.as_dict(),
            "modelled": self.modelled,
            "step_s": self.step_s,
            "longest_seq": self.longest,
            "error": self.error,
        }


def step_seconds(config, spec: SequenceSpec, setup: Setup, ep: int = 1, tp: int = 1) -> float:
    """Modelled seconds of one step on one rank (``step_parts`` summed)."""
    return sum(step_parts(config, spec, setup, ep, tp).values())


def step_parts(config, spec: SequenceSpec, setup: Setup, ep: int = 1, tp: int = 1) -> dict:
    """Modelled seconds of one step on one rank: the decoder's attention from the cost model (on
    H / tp heads), the matmuls of the parameters a token multiplies (a MoE layer's experts at
    K / E; the TP-split projections / tp) at ``ACHIEVED_FLOPS``, and the exposed EP and TP
    communication, and FSDP2's traffic beyond what the compute hides (``cpvlm.simulate.parallel_cost``)."""
    from cpvlm import ShardPlan
    from cpvlm.attention.cost import Shapes, estimate_seconds
    from cpvlm.simulate.parallel_cost import comm_seconds, model_facts

    text = config.text_config
    plan = ShardPlan(spec.seq_len, setup.cp)
    heads, kv = text.num_attention_heads, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    shapes = Shapes(
        1, heads // tp, max(1, kv // tp), head_dim, setup.compute_dtype or setup.master_dtype
    )
    impl = setup.attn if setup.cp > 1 else "ring"
    u = None
    if impl == "hybrid":
        raise ValueError("plan: attn='hybrid' needs a ulysses size; use ring, allgather or ulysses")
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    attn_layers = sum(t == "full_attention" for t in types)
    window = getattr(text, "sliding_window", None)
    attn_s = attn_layers * estimate_seconds(impl, plan, True, shapes, u, "cuda")
    if window and "sliding_attention" in types:  # each query sees at most a window of keys
        per_layer = (
            4 * plan.local_len * min(window, spec.seq_len) * heads // tp * head_dim / ACHIEVED_FLOPS
        )
        attn_s += sum(t == "sliding_attention" for t in types) * per_layer * 3.5
    facts = model_facts(config)
    multiplied = facts.active_params - facts.tp_params * (1 - 1 / tp)
    flops = (8 if setup.activation_checkpointing else 6) * multiplied * plan.local_len
    comm = comm_seconds(
        facts, plan.local_len, setup.dp * setup.cp, ep, tp, setup.activation_checkpointing
    )
    compute = attn_s + flops / ACHIEVED_FLOPS
    # FSDP2 prefetches the next layer's gather while this one computes: what compute cannot hide
    comm["fsdp_exposed_s"] = max(0.0, comm.pop("fsdp_s") - compute)
    return {"attention_s": attn_s, "matmul_s": flops / ACHIEVED_FLOPS, **comm}


def candidates(gpus: int, cps, attns, checkpointing, chunks) -> list[Setup]:
    out = []
    for cp in cps:
        if gpus % cp:
            continue
        for attn in attns if cp > 1 else ["ring"]:
            for ac in checkpointing:
                for chunk in chunks:
                    out.append(
                        Setup(
                            dp=gpus // cp,
                            cp=cp,
                            attn=attn,
                            activation_checkpointing=ac,
                            loss_chunk=chunk,
                        )
                    )
    return out


def _economy(setup: Setup) -> tuple:
    """Sort key: the setups that need the least memory first (largest cp, checkpointing on,
    smallest loss chunk)."""
    return (-setup.cp, not setup.activation_checkpointing, setup.loss_chunk or 2**62)


def _needs_no_more(a: Setup, b: Setup) -> bool:
    """Whether ``a`` needs no more memory per rank than ``b``: the same attention and ranks, at
    least b's cp, checkpointing where b has it, a loss chunk no larger."""
    return (
        a.attn == b.attn
        and a.dp * a.cp == b.dp * b.cp
        and a.cp >= b.cp
        and (a.activation_checkpointing or not b.activation_checkpointing)
        and (a.loss_chunk or 2**62) <= (b.loss_chunk or 2**62)
    )


def evaluate(
    config, spec: SequenceSpec, setups, gpu_mem_gib: float, progress=None
) -> list[Candidate]:
    """Simulate the setups, least memory first (a ValueError of one becomes its ``error``). A
    setup that needs no less memory than one already found not to fit is not simulated (its
    ``error`` says which)."""
    budget = int(gpu_mem_gib * GiB)
    cache: dict = {}  # the optimizer step and shard sizes, shared by the setups of a mesh
    out, too_big = {}, []
    for setup in sorted(setups, key=_economy):
        if progress is not None:
            progress.set_description(
                f"cp={setup.cp} attn={setup.attn} ac={int(setup.activation_checkpointing)} chunk={setup.loss_chunk}"
            )
        over = next((a for a in too_big if _needs_no_more(a, setup)), None)
        if over is not None:
            cand = Candidate(
                setup,
                None,
                error=f"not simulated: needs at least the {out[over].memory.steady_peak / GiB:.1f} "
                f"GiB of cp={over.cp} ac={int(over.activation_checkpointing)} "
                f"chunk={over.loss_chunk}",
            )
        else:
            try:
                memory = simulate_step(config, spec, setup, cache)
                cand = Candidate(setup, memory, step_s=step_seconds(config, spec, setup))
                fixed = memory.params + memory.grads + memory.optimizer
                act = memory.steady_peak - fixed
                cand.longest = int(spec.seq_len * (budget - fixed) / act) if budget > fixed else 0
                if not cand.fits(budget):
                    too_big.append(setup)
            except (ValueError, NotImplementedError, RuntimeError) as err:
                cand = Candidate(
                    setup, None, error=f"{type(err).__name__}: {err}".splitlines()[0][:300]
                )
        out[setup] = cand
        if progress is not None:
            progress.update(1)
    return [out[s] for s in setups]


def with_ep_tp(config, spec: SequenceSpec, simulated, eps, tp: int, gpu_mem_gib: float):
    """The candidates of every ``ep`` in ``eps`` at ``tp`` from the simulated ep = tp = 1 ranks
    (each of dp x cp = gpus / tp ranks): ep = tp = 1 as simulated, the others modelled
    (``cpvlm.simulate.parallel_cost.modelled_memory``), or an error naming the size that does
    not divide."""
    from cpvlm.parallelize.expert_parallel import check_experts
    from cpvlm.simulate.parallel_cost import model_facts, modelled_memory

    facts = model_facts(config)
    budget = int(gpu_mem_gib * GiB)
    out = []
    for base in simulated:
        for ep in eps:
            if ep == 1 and tp == 1:
                out.append(base)
                continue
            cand = Candidate(base.setup, base.memory, ep=ep, tp=tp)
            out.append(cand)
            try:
                check_experts(ep, facts.experts or None, "ep", "--ep")
                world = base.setup.dp * base.setup.cp
                if world % ep:
                    raise ValueError(f"--ep {ep} must divide dp x cp = {world} (EP borrows them)")
                if tp > 1 and facts.tp_error:
                    raise ValueError(facts.tp_error)
                if facts.heads % tp or facts.kv_heads % tp:
                    raise ValueError(
                        f"--tp {tp} must divide the {facts.heads} query and {facts.kv_heads} "
                        "key-value heads"
                    )
            except ValueError as err:
                cand.error = str(err).splitlines()[0][:300]
                continue
            if base.memory is None:
                cand.error = base.error
                continue
            local = base.memory.local_len
            cand.modelled = modelled_memory(base.memory, facts, world, ep, tp, local)
            cand.step_s = step_seconds(config, spec, base.setup, ep, tp)
            fixed = cand.modelled["weights"]
            act = cand.modelled["peak"] - fixed
            cand.longest = int(spec.seq_len * (budget - fixed) / act) if budget > fixed else 0
    return out
