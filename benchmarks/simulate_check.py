"""The simulated rank (cpvlm.simulate, fake tensors) against the real CPU run, cp 1, 2, 4.

    python benchmarks/simulate_check.py --model tiny    # qwen3-vl-tiny, 1024 tokens: ~minutes
    python benchmarks/simulate_check.py --model mid     # ~400 MB model (MID_TEXT), 4096 tokens
    python benchmarks/simulate_check.py --depth         # reduced depth against every layer

--depth: the simulation of a few layers with the rest added (cpvlm.simulate.depth, "affine" and
"add") against the simulation of every layer, as the scale table runs it (FSDP2 over cp, bf16
compute, AdamW, activation checkpointing, loss chunk 1024): an 8-layer tiny Qwen3-VL and the
published Qwen3-VL-8B (--points). Saved bytes must be equal; the peaks are compared.

Real: gloo ranks, float32, ring attention, measured by benchmarks/memory.py's StepMemory (live
tensor bytes, saved-for-backward bytes). Simulated: the same step, one rank at a time, on fake
tensors with a fake process group, measured by torch's MemTracker (cpvlm.testing.memory_check
says what is compared). Per rank: saved bytes (must be equal) and the peak (sim/real).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import parser, print_table, write_json  # noqa: E402

# A mid-size Qwen3-VL (~105M parameters, ~420 MB in float32): text hidden 1024, 4 layers,
# vocabulary 32768; a 2-block vision tower of hidden 256.
MID_TEXT = {
    "vocab_size": 32768,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 32768,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5_000_000.0,
        "mrope_section": [12, 10, 10],
        "mrope_interleaved": True,
    },
}
MID_VISION = {
    "depth": 2,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_heads": 4,
    "out_hidden_size": 1024,
    "num_position_embeddings": 1024,
}


DEPTH_POINTS = ("tiny text 2", "tiny video 2", "tiny text 4", "qwen3-vl-8b text 8")


def depth_check(points, out_dir) -> None:
    import os
    import time
    from dataclasses import replace

    from cpvlm.hf import TINY_MODELS
    from cpvlm.simulate import SequenceSpec, Setup, load_config, simulate_step

    rows = []
    for point in points:
        model, kind, cp = point.split()
        if model == "tiny":
            config = TINY_MODELS["qwen3-vl-tiny"](
                text_config={"num_hidden_layers": 8},
                vision_config={"depth": 6, "deepstack_visual_indexes": [1, 3]},
            )
            n, video = 512, (4, 64, 64)
        else:
            config, n, video = load_config(model), 32768, (300, 448, 448)
        spec = SequenceSpec(n, videos=(video,) if kind == "video" else ())
        setup = Setup(cp=int(cp), activation_checkpointing=True, loss_chunk=1024)
        runs = {}
        for fit, s in (
            ("full", replace(setup, reduced_depth=False)),
            ("affine", replace(setup, depth_fit="affine")),
            ("add", replace(setup, depth_fit="add")),
        ):
            cpu = time.process_time()
            runs[fit] = (simulate_step(config, spec, s), time.process_time() - cpu)
        full = runs["full"][0]
        for fit, (m, cpu) in runs.items():
            rows.append(
                {
                    "model": model,
                    "seq": f"{kind} {n}",
                    "cp": int(cp),
                    "fit": fit,
                    "saved_equal": m.saved == full.saved,
                    "weights_equal": (m.params, m.grads, m.optimizer)
                    == (full.params, full.grads, full.optimizer),
                    "peak_fwd_bwd/full": m.peak_fwd_bwd / full.peak_fwd_bwd,
                    "steady_peak/full": m.steady_peak / full.steady_peak,
                    "peak_GiB": m.steady_peak / 2**30,
                    "cpu_s": cpu,
                    "load1": os.getloadavg()[0],
                }
            )
            print_table(rows[-1:], list(rows[-1]))
        write_json(out_dir, "simulate_check_depth", {"rows": rows})
    print_table(rows, list(rows[0]), "reduced depth against every layer")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--depth", action="store_true", help="reduced depth against every layer")
    p.add_argument("--points", nargs="+", default=list(DEPTH_POINTS), help="'MODEL KIND CP'")
    p.add_argument("--model", choices=["tiny", "mid"], default="tiny")
    p.add_argument("--cp", type=int, nargs="*", default=[1, 2, 4])
    p.add_argument("--loss-chunk", type=int, default=0, help="loss chunk (0: whole logits)")
    args = p.parse_args()
    if args.depth:
        depth_check(args.points, args.out_dir)
        return
    from cpvlm.hf import TINY_MODELS
    from cpvlm.simulate import SequenceSpec
    from cpvlm.testing import run_distributed
    from cpvlm.testing.memory_check import real_step, simulated_step

    if args.model == "tiny":
        config = TINY_MODELS["qwen3-vl-tiny"]()
        spec = SequenceSpec(1024, images=((128, 128), (64, 96)), videos=((8, 128, 128),), docs=2)
    else:
        config = TINY_MODELS["qwen3-vl-tiny"](text_config=MID_TEXT, vision_config=MID_VISION)
        spec = SequenceSpec(4096, images=((256, 256), (384, 384)), videos=((8, 256, 256),), docs=3)
    rows, chunk = [], args.loss_chunk or None
    for cp in args.cp:
        real = run_distributed(real_step, cp, config, spec, "ring", chunk, timeout=1800)
        for rank in range(cp):
            sim = simulated_step(config, spec, cp, rank, "ring", chunk)
            rows.append(
                {
                    "cp": cp,
                    "rank": rank,
                    "saved_real": real[rank]["saved"],
                    "saved_sim": sim["saved"],
                    "saved_equal": real[rank]["saved"] == sim["saved"],
                    "peak_real_MiB": real[rank]["peak"] / 2**20,
                    "peak_sim_MiB": sim["peak"] / 2**20,
                    "sim/real": sim["peak"] / real[rank]["peak"],
                }
            )
            print_table(rows[-1:], list(rows[-1]))
    print_table(rows, list(rows[0]), f"simulated vs real, {args.model} config")
    write_json(
        args.out_dir,
        f"simulate_check_{args.model}",
        {"spec": str(spec), "loss_chunk": chunk, "rows": rows},
    )


if __name__ == "__main__":
    main()
