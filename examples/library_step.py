# ruff: noqa: E402  (the README block below starts with its own imports)
"""One training step of a transformers VLM under context parallelism, with cpvlm's library API.

    torchrun --nproc-per-node 4 examples/library_step.py             # tiny Qwen3-VL, 2 x 2, CPU
    torchrun --nproc-per-node 8 examples/library_step.py --cp 4 --model /path/to/checkpoint

The README's "Using it" example is the block between the two ``----`` lines below, as it is
there. The ranks form a (dp_shard, cp) mesh; each DP replica trains on its own microbatches
(synthetic ones here: images of two sizes and a text-only row, in the model family's layout),
and rank 0 prints the step's loss, the mean over every valid label of every microbatch of
every replica: what one process gives for the whole global batch. gloo on CPU; for GPUs use
"nccl", ``torch.cuda.set_device(local_rank)`` and ``build_mesh(..., device_type="cuda")``.
"""

import argparse

import torch
import torch.distributed as dist

from cpvlm.hf import SampleSpec, synthetic_batch

SAMPLES = [SampleSpec(images=((4, 4), (8, 4)), text_len=20), SampleSpec(text_len=30)]


def synthetic_microbatches(model, dp_rank: int, count: int = 2) -> list[dict]:
    """This DP replica's microbatches, the same on each of its CP ranks (labels unshifted)."""
    return [synthetic_batch(model.config, SAMPLES, seed=100 * dp_rank + i) for i in range(count)]


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", default="qwen3-vl-tiny", help="a tiny model or a checkpoint dir")
parser.add_argument("--cp", type=int, default=2, help="ranks per sequence; dp_shard = world / cp")
args = parser.parse_args()
dist.init_process_group("gloo")
checkpoint, cp, dp_shard = args.model, args.cp, dist.get_world_size() // args.cp

# ---- README: Using it ----
# under torchrun, after dist.init_process_group(); checkpoint, cp and dp_shard = world / cp given
# (examples/library_step.py runs this block as it is here)
from cpvlm import CPOptions, build_mesh, count_valid_labels, mesh_groups, parallelize, shift_labels
from cpvlm.hf import ContextParallelVLM, adapter_for, build_model

mesh = build_mesh(dp_shard=dp_shard, cp=cp)  # dp_shard x cp ranks, cp innermost
groups = mesh_groups(mesh)
model = build_model(checkpoint)  # a checkpoint directory, or "qwen3-vl-tiny" (random weights)
options = CPOptions(attn="ring", vision="route")  # cpvlm.options: every CP option, checked
cp_model = ContextParallelVLM(model, groups.cp_group, options=options)
units = adapter_for(model).fsdp_units(model)  # FSDP2 units: decoder layers + vision tower
runner = parallelize(cp_model, mesh, data_parallel="fsdp", groups=groups, fsdp_units=units)
optimizer = torch.optim.AdamW(runner.parameters(), lr=1e-4)

# Every CP rank of a DP replica passes the same full batches (a processor's output, labels
# unshifted); N counts the shifted valid labels of all microbatches of the step, over DP.
microbatches = synthetic_microbatches(model, groups.dp_rank)  # or your loader's
num_valid = count_valid_labels([shift_labels(b["labels"]) for b in microbatches], groups.dp_group)
loss = torch.zeros(())
for batch in microbatches:
    # num_batches: the step's forward batches, over which per-batch losses (MoE router) average
    out = runner(**batch, num_valid=num_valid, num_batches=len(microbatches) * dp_shard)
    out.loss.backward()  # the sync sums gradients over dp x cp
    loss += out.loss.detach()  # this rank's share of the step's loss
optimizer.step()
optimizer.zero_grad()
dist.all_reduce(loss)  # the shares of every rank: the step's token-mean loss
if dist.get_rank() == 0:
    print(f"loss {loss.item():.8f}")
dist.destroy_process_group()  # before exit: a gloo group left to interpreter shutdown can abort
# the process ("terminate called without an active exception")
# ---- end of the README block ----
