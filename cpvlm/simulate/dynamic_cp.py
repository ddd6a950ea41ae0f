"""Dynamic CP, modelled: a long-tailed step's time at static CP against dynamic CP on GPUs.

Legend: S the longest row (``--seq-len``), R rows per DP replica per step, C the CP size.

A step's rows come from a mix (``MIXES``; deterministic quantiles, not draws, so a figure is a
function of its arguments), each row one sample of ``SampleMeta`` size:

    text    the R / R quantiles of a log-normal length (median S / 64, sigma 1.5) capped at S,
            the longest row S: a few long documents, many short ones.
    video   one row in 16 a video filling S (512 x 512 pixel frames: 32 x 32 patches of 16,
            256 tokens each after the 2 x 2 merge), the others image conversations: one 448 x 448
            image and text of log-normal length (median 1k tokens, sigma 1).

Each row's cost is ``RowCost`` of the model (forward MACs) and a job's time is
``cpvlm.data.dynamic_cp.JobTimes`` with the cost model's published H100 figures
(``cpvlm.attention.cost.CUDA_NCCL``: matrices at the attention kernel's throughput, 20 us per
message, 200 GB/s, 10 us per kernel call) and FSDP2's gathers of a round from
``cpvlm.simulate.parallel_cost.fsdp_seconds`` over the dp x C ranks. Static CP runs every row over
all C ranks, one round a row; dynamic CP is ``plan_dynamic_cp`` with those times and the memory
rule's budget ceil(S / C) tokens of a row per rank: no rank holds more of a row than under static
CP, so the peak memory per rank is static CP's (the simulated candidate's) by construction.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from statistics import NormalDist

from cpvlm.data.dynamic_cp import JobTimes, plan_dynamic_cp, plan_rounds
from cpvlm.data.meta import SampleMeta

PATCH, MERGE = 16, 2  # the mixes' pixels to patches (Qwen3-VL's); tokens = patches / MERGE^2


def lognormal_quantiles(count: int, median: float, sigma: float) -> list[float]:
    """The (i + 1/2) / count quantiles of a log-normal, largest first."""
    normal = NormalDist(math.log(median), sigma)
    return [math.exp(normal.inv_cdf(1 - (i + 0.5) / count)) for i in range(count)]


def text_mix(seq_len: int, rows: int) -> list[SampleMeta]:
    lengths = [
        min(seq_len, max(16, round(x))) for x in lognormal_quantiles(rows, seq_len / 64, 1.5)
    ]
    return [SampleMeta(seq_len)] + [SampleMeta(n) for n in lengths[1:]]


def video_mix(seq_len: int, rows: int) -> list[SampleMeta]:
    side = 512 // PATCH
    per_frame = side * side // MERGE**2
    frames = max(1, (seq_len - 256) // per_frame)
    video = SampleMeta(frames * per_frame + 256, (), ((frames, side, side),))
    image = (1, 448 // PATCH, 448 // PATCH)
    image_tokens = image[1] * image[2] // MERGE**2
    videos = max(1, rows // 16)
    chats = [
        SampleMeta(min(seq_len, image_tokens + max(16, round(x))), (image,))
        for x in lognormal_quantiles(rows - videos, 1024, 1.0)
    ]
    return [video] * videos + chats


MIXES = {"text": text_mix, "video": video_mix}


def job_times(config, world: int, device_type: str = "cuda", dtype_bytes: int = 2) -> JobTimes:
    """``JobTimes`` of a transformers VLM config on ``world`` = dp x C ranks (module docstring)."""
    from cpvlm.attention.cost import cost_model
    from cpvlm.hf.data.row_cost import row_cost
    from cpvlm.simulate.parallel_cost import fsdp_seconds, model_facts

    text = config.text_config
    costs, model, facts = row_cost(config), cost_model(device_type), model_facts(config)
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    layers = sum(t != "linear_attention" for t in types)
    return JobTimes(
        mac_s=model.pair_s / 2,  # 2 MACs per (pair x head x D): q.k and the weighted sum of v
        backward_factor=model.backward_factor,
        token=costs.token,
        pair=costs.pair,
        layers=layers,
        kv_bytes=2 * kv * head_dim * dtype_bytes,
        acc_bytes=2 * kv * head_dim * 4,
        call_s=model.call_s,
        message_s=model.message_s,
        link_bytes_per_s=model.link_bytes_per_s,
        # FSDP2: a gather, a backward gather and a reduce-scatter per layer, each a message
        round_s=3 * facts.layers * model.message_s,
        gather_s=fsdp_seconds(facts, world, 1, 1) if world > 1 else 0.0,
    )


@dataclass(frozen=True)
class Comparison:
    """One step at one C: static and dynamic CP under the same ``JobTimes``."""

    cp: int
    rows: int
    static_s: float
    dynamic_s: float
    sizes: dict[int, int]  # rows per c
    rounds: int
    balance: float  # busy rank-time over the group's (``DynamicPlan.balance``)
    ideal_s: float  # every row's compute spread evenly over the C ranks, nothing else
    plan_ms: float  # host seconds of ``plan_dynamic_cp`` (process time), in ms

    @property
    def speedup(self) -> float:
        return self.static_s / self.dynamic_s

    def as_dict(self) -> dict:
        return {
            "cp": self.cp,
            "rows": self.rows,
            "static_s": self.static_s,
            "dynamic_s": self.dynamic_s,
            "speedup": self.speedup,
            "sizes": {str(c): n for c, n in sorted(self.sizes.items())},
            "rounds": self.rounds,
            "balance": self.balance,
            "ideal_s": self.ideal_s,
            "plan_ms": self.plan_ms,
        }


def compare(
    config, metas: list[SampleMeta], seq_len: int, cp: int, dp: int = 1, times=None
) -> Comparison:
    """Static against dynamic CP for one DP replica's rows ``metas`` (module docstring), under
    ``times`` (default ``job_times`` of ``config`` at world dp x cp)."""
    from cpvlm.hf.data.row_cost import row_cost

    cost = row_cost(config)
    tokens = [m.tokens for m in metas]
    costs = [cost.sample(m) for m in metas]
    times = times or job_times(config, dp * cp)
    static = plan_rounds(costs, [cp] * len(metas), cp)
    start = time.process_time()
    plan = plan_dynamic_cp(tokens, costs, cp, -(-seq_len // cp), times=times)
    plan_ms = (time.process_time() - start) * 1e3
    return Comparison(
        cp=cp,
        rows=len(metas),
        static_s=static.modelled_seconds(tokens, costs, times),
        dynamic_s=plan.modelled_seconds(tokens, costs, times),
        sizes=dict(plan.sizes()),
        rounds=len(plan.rounds),
        balance=plan.balance(costs),
        ideal_s=(1 + times.backward_factor) * times.mac_s * sum(costs) / cp,
        plan_ms=plan_ms,
    )
