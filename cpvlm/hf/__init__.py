"""Hugging Face transformers VLMs under CP: the family-agnostic core, the family protocol and
the Trainer route (the families themselves are ``cpvlm.families``, one file each).

Read in this order: adapter.py (what a family says to the CP step), kit.py (what it says to
tests and verify), ``cpvlm/families/`` (one file per family, each registered in
registration.py), registry.py (model class -> adapter), inputs.py (the replicated integer inputs
of a step), context_parallel.py (ContextParallelVLM, one step top to bottom), attention.py.

data/ is the data path of a checkpoint's processor (processor.py) and synthetic batches in any
family's layout (``cpvlm train --data synthetic``, ``cpvlm verify``, the examples);
tiny_checkpoint.py writes a tiny checkpoint directory with a real processor; float64.py keeps
transformers' float32 casts in float64 for a float64 reference; versions.py warns once when
transformers (or trl, peft, ...) is outside the tested window; trainer.py and trl.py are the
Trainer / TRL route.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# First: importing it warns when a library is outside the tested window, before any family
# import that such a release might break.
from cpvlm.hf import versions  # noqa: F401

# The public names load on first use (PEP 562): the families import the protocol modules of this
# package (adapter, kit, registration), and the CP step imports the families through the
# registry, so an __init__ that imported the CP step would close an import circle.
_EXPORTS = {
    "CPAttentionContext": "cpvlm.hf.attention",
    "CP_ATTENTION": "cpvlm.hf.attention",
    "ContextParallelOutput": "cpvlm.hf.context_parallel",
    "ContextParallelVLM": "cpvlm.hf.context_parallel",
    "FamilyKit": "cpvlm.hf.kit",
    "IGNORE_INDEX": "cpvlm.loss",
    "ModulePaths": "cpvlm.hf.adapter",
    "PreparedBatch": "cpvlm.hf.inputs",
    "RouterLoss": "cpvlm.hf.adapter",
    "SampleSpec": "cpvlm.hf.data.synthetic",
    "TINY_MODELS": "cpvlm.hf.models",
    "VLMAdapter": "cpvlm.hf.adapter",
    "adapter_for": "cpvlm.hf.registry",
    "build_model": "cpvlm.hf.models",
    "kit_for": "cpvlm.hf.registry",
    "model_family": "cpvlm.hf.models",
    "pack_documents": "cpvlm.hf.data.synthetic",
    "prepare_batch": "cpvlm.hf.inputs",
    "register": "cpvlm.hf.registration",
    "row_cost": "cpvlm.hf.data.row_cost",
    "supported": "cpvlm.hf.registry",
    "synthetic_batch": "cpvlm.hf.data.synthetic",
    "vision_cost": "cpvlm.hf.vision_cost",
}

__all__ = [
    "CPAttentionContext",
    "CP_ATTENTION",
    "ContextParallelOutput",
    "ContextParallelVLM",
    "FamilyKit",
    "IGNORE_INDEX",
    "ModulePaths",
    "PreparedBatch",
    "RouterLoss",
    "SampleSpec",
    "TINY_MODELS",
    "VLMAdapter",
    "adapter_for",
    "build_model",
    "kit_for",
    "model_family",
    "pack_documents",
    "prepare_batch",
    "register",
    "row_cost",
    "supported",
    "synthetic_batch",
    "vision_cost",
]  # = _EXPORTS' keys (tests/test_imports.py)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cpvlm.hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from cpvlm.hf.adapter import ModulePaths, RouterLoss, VLMAdapter
    from cpvlm.hf.attention import CP_ATTENTION, CPAttentionContext
    from cpvlm.hf.context_parallel import ContextParallelOutput, ContextParallelVLM
    from cpvlm.hf.data.row_cost import row_cost
    from cpvlm.hf.data.synthetic import SampleSpec, pack_documents, synthetic_batch
    from cpvlm.hf.inputs import PreparedBatch, prepare_batch
    from cpvlm.hf.kit import FamilyKit
    from cpvlm.hf.models import TINY_MODELS, build_model, model_family
    from cpvlm.hf.registration import register
    from cpvlm.hf.registry import adapter_for, kit_for, supported
    from cpvlm.hf.vision_cost import vision_cost
    from cpvlm.loss import IGNORE_INDEX
