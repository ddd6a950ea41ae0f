"""The memory options of a CP step are exact: the chunked loss (``loss_chunk``) and activation
checkpointing (transformers' own, decoder layers and vision blocks recomputed in the backward)
give the loss and every gradient of the plain CP step.

float64 on 2 and 3 gloo ranks, a batch with images of several sizes, a video and a text-only
row, and a packed row of documents. 1e-10 relative: the chunked loss sums the same terms in
another order (its gradients are folded chunk by chunk), and the recompute repeats the same ops
on the same inputs; observed <= 1e-15.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from cpvlm.hf import ContextParallelVLM, build_model
from cpvlm.verify import cp_loss_and_grads, rel_err, run_distributed, verify_batches

VARIANTS = {  # name: (loss_chunk, activation checkpointing)
    "plain": (None, False),
    "chunked": (5, False),
    "checkpointed": (None, True),
    "both": (16, True),
}


def _step(rank, world_size, names):
    base = build_model("qwen3-vl-tiny", dtype=torch.float64, seed=0)
    out = {}
    for batch_name, (batch, doc_lens) in verify_batches(base, torch.float64).items():
        for name in names:
            chunk, checkpointed = VARIANTS[name]
            model = copy.deepcopy(base)
            if checkpointed:
                model.activation_checkpointing_enable({"use_reentrant": False})
            calls = []
            layer = model.model.language_model.layers[0]
            # Pre-hooks on each layer's first module: a recompute may stop once it has what the
            # backward needs, before a later module's forward returns.
            hook = layer.input_layernorm.register_forward_pre_hook(lambda *a, c=calls: c.append(1))
            block = model.model.visual.blocks[0]
            vision_hook = block.norm1.register_forward_pre_hook(lambda *a, c=calls: c.append(2))
            cp_model = ContextParallelVLM(model, dist.group.WORLD, loss_chunk=chunk)
            _, loss, grads = cp_loss_and_grads(cp_model, batch, doc_lens)
            hook.remove()
            vision_hook.remove()
            out[batch_name, name] = (loss, grads, calls.count(1), calls.count(2))
    return out


@pytest.mark.parametrize(
    "world_size, names", [(2, list(VARIANTS)), (3, ["plain", "both"])], ids=["cp2", "cp3"]
)
def test_chunked_loss_and_activation_checkpointing_equal_the_plain_step(world_size, names):
    results = run_distributed(_step, world_size, names, timeout=300)
    for rank_result in results:
        for batch in ("mixed", "packed"):
            loss, grads, layer_calls, vision_calls = rank_result[batch, "plain"]
            assert layer_calls == 1
            for name in names:
                checkpointed = VARIANTS[name][1]
                other_loss, other_grads, other_calls, other_vision = rank_result[batch, name]
                # Recomputed in the backward: each layer (and the rank's vision block) runs twice.
                assert other_calls == (2 if checkpointed else 1), (batch, name)
                assert other_vision == vision_calls * (2 if checkpointed else 1), (batch, name)
                assert rel_err(other_loss, loss) <= 1e-10, (batch, name)
                worst = max(grads, key=lambda n: rel_err(other_grads[n], grads[n]))
                assert rel_err(other_grads[worst], grads[worst]) <= 1e-10, (batch, name, worst)
