"""The simulated rank (cpvlm.simulate, fake tensors) against the real CPU run, cp 1, 2, 4.

    python benchmarks/simulate_check.py --model tiny    # qwen3-vl-tiny, 1024 tokens: ~minutes
    python benchmarks/simulate_check.py --model mid     # benchmarks/memory.py's model, 4096 tokens

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


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", choices=["tiny", "mid"], default="tiny")
    p.add_argument("--cp", type=int, nargs="*", default=[1, 2, 4])
    args = p.parse_args()
    from memory import VOCAB_DOCS, model_config

    from cpvlm.integrations.hf import TINY_MODELS
    from cpvlm.simulate import SequenceSpec
    from cpvlm.testing import run_distributed
    from cpvlm.testing.memory_check import real_step, simulated_step

    if args.model == "tiny":
        config = TINY_MODELS["qwen3-vl-tiny"]()
        spec = SequenceSpec(1024, images=((128, 128), (64, 96)), videos=((8, 128, 128),), docs=2)
    else:
        config = model_config()
        spec = SequenceSpec(4096, images=((256, 256), (384, 384)), docs=len(VOCAB_DOCS))
    rows = []
    for cp in args.cp:
        real = run_distributed(real_step, cp, config, spec, "ring", None, timeout=1800)
        for rank in range(cp):
            sim = simulated_step(config, spec, cp, rank, "ring", None)
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
    write_json(args.out_dir, f"simulate_check_{args.model}", {"spec": str(spec), "rows": rows})


if __name__ == "__main__":
    main()
