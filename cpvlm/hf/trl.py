"""TRL's SFTTrainer under cpvlm's context parallelism, packing included.

``ContextParallelSFTTrainer(..., cp_size=C)`` is ``SFTTrainer`` with ``ContextParallelMixin``
(see ``cpvlm.hf.trainer``). TRL refuses ``packing=True`` for vision datasets (and
under its own CP, whose causal mask would let packed documents see each other); here
``SFTConfig(packing=True)`` packs each collated batch into one row with cpvlm's ``doc_lens``, so
every document attends only to itself and its labels are shifted within it. TRL's own packing of
text datasets (``seq_lengths``, padding-free position ids) is replaced by the same.
"""

from __future__ import annotations

from cpvlm.hf.trainer import ContextParallelMixin


def _sft_trainer_class():
    from trl import SFTTrainer

    class ContextParallelSFTTrainer(ContextParallelMixin, SFTTrainer):
        """``trl.SFTTrainer`` under cpvlm's CP: ``ContextParallelSFTTrainer(..., cp_size=C)``."""

        def __init__(self, *args, cp_size: int = 1, cp_options=None, **kwargs):
            config = kwargs.get("args", args[1] if len(args) > 1 else None)
            pack = bool(config is not None and config.packing)
            if pack:  # cpvlm packs (per-document masks); TRL must not
                config.packing = False
                config.padding_free = False
            super().__init__(*args, cp_size=cp_size, cp_options=cp_options, pack=pack, **kwargs)

    return ContextParallelSFTTrainer


def __getattr__(name: str):
    if name == "ContextParallelSFTTrainer":  # trl imported on first use only
        cls = _sft_trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
