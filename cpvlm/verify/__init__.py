"""`cpvlm verify`: check a model's CP loss and gradients against the one-process run, and the
engine behind it, which the exactness tests call too.

    batches.py     the check's batches: a mixed padded batch and a packed row of documents
    reference.py   the unwrapped model's own forward and backward on one process (moe_reference.py:
                   the router load-balancing loss written out from transformers' definition)
    step.py        the CP side on every rank: one step, loss and gradients summed over the ranks
    compare.py     relative errors per parameter and module group, and their tolerances
    runner.py      run a function on N gloo processes with timeouts and rank tracebacks
    command.py     ``run_verify`` (the table) and the command line
"""

from cpvlm.verify.batches import mixed_batch, packed_documents, verify_batches
from cpvlm.verify.command import (
    CHECKED_IMPLS,
    Case,
    VerifyConfig,
    add_arguments,
    build_parser,
    default_cp_model,
    hybrid_size,
    main,
    run_verify,
)
from cpvlm.verify.compare import (
    FLOAT32_IN_FLOAT64,
    TOLERANCES,
    compare,
    gradient_errors,
    group_of,
    module_groups,
    rel_err,
    tolerance,
)
from cpvlm.verify.moe_reference import switch_load_balancing_loss
from cpvlm.verify.reference import (
    causal_lm_loss,
    causal_lm_loss_sum,
    mrope_position_ids,
    reference,
    reference_loss_and_grads,
)
from cpvlm.verify.runner import DistributedTestError, run_distributed, shutdown_pools
from cpvlm.verify.step import cp_loss_and_grads, summed_gradients

__all__ = [
    "CHECKED_IMPLS",
    "Case",
    "DistributedTestError",
    "FLOAT32_IN_FLOAT64",
    "TOLERANCES",
    "VerifyConfig",
    "add_arguments",
    "build_parser",
    "causal_lm_loss",
    "causal_lm_loss_sum",
    "compare",
    "cp_loss_and_grads",
    "default_cp_model",
    "gradient_errors",
    "group_of",
    "hybrid_size",
    "main",
    "mixed_batch",
    "module_groups",
    "mrope_position_ids",
    "packed_documents",
    "reference",
    "reference_loss_and_grads",
    "rel_err",
    "run_distributed",
    "run_verify",
    "shutdown_pools",
    "summed_gradients",
    "switch_load_balancing_loss",
    "tolerance",
    "verify_batches",
]
