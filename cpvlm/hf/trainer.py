"""transformers.Trainer (and TRL's SFTTrainer) under cpvlm's context parallelism.

A user's Trainer script gains CP by changing its trainer class and passing ``cp_size``::

    from cpvlm.hf.trainer import ContextParallelTrainer
    trainer = ContextParallelTrainer(model=model, args=args, ..., cp_size=2)

(or ``class MyTrainer(ContextParallelMixin, SFTTrainer)`` for any Trainer subclass), launched
with ``torchrun`` on ``dp x cp`` ranks, CP groups of ``cp`` consecutive ranks as in ``cpvlm
train``. What changes inside the Trainer, and why:

- The model runs as ``ContextParallelVLM`` (the HF model stays ``trainer.model``, so
  ``save_model``, checkpoints and PEFT adapters are written as usual), wrapped in DDP over every
  rank: the gradient of each CP rank's share is summed over CP, and DDP's mean over the world
  becomes the Trainer's usual average because each share is multiplied by the world size, as
  Trainer does with ``average_tokens_across_devices``.
- With ``fsdp`` (``fsdp_config={"version": 2}``, accelerate's FSDP2, also on CPU/gloo) the HF
  model is ``fully_shard``-ed over every rank by accelerate instead, ``ContextParallelVLM``
  runs as an FSDP forward method of it, and FSDP2's mean over the world replaces DDP's;
  ``save_model`` writes the full state dict. Checkpoints under FSDP are refused for now.
- Batches are sharded by DP rank, not by process: every CP rank of a replica loads the same one.
- ``num_items_in_batch`` is N, the step's count of valid *shifted* labels (per packed document)
  over every microbatch and DP replica (``cpvlm.loss.count_valid_labels``), so the loss of every
  microbatch on every rank is its share of the one global token mean; the logged loss, the mean
  of the ranks' ``share * world``, is that token mean.
- ``pack=True``: each collated batch becomes one packed row with ``doc_lens`` (the rows' real
  lengths), so documents attend only within themselves (``cp_attention``'s document mask).
- ``ep=N`` / ``tp=N`` (expert / tensor parallelism, as ``cpvlm train --ep / --tp``): the world
  is ``dp x cp x tp`` ranks on one ``build_mesh(dp_shard, cp, ep, tp)`` mesh. The HF model's
  decoder layers are split over TP (``apply_tensor_parallel``) and its experts sharded over EP
  (``parallelize``) once, in ``__init__``, before the optimizer sees the parameters. Neither
  DDP nor FSDP2 can sum gradients that are shards on other meshes, so there is no data-parallel
  wrapper: each rank's gradient is its share's, and after the step's last backward
  ``sync_step_gradients`` sums them as ``cpvlm train --data-parallel none`` does (over dp x cp
  per tp slice, the experts over their replicas, TP-partial norms over TP); the norm and clipping
  span every mesh (``cpvlm.parallelize.gradients``, the loop's). The logged loss is still the
  token mean: each rank's loss reads ``share * dp * cp`` (its TP ranks log the same value) while
  its gradient stays the share's. ``save_model`` writes the whole model (the shards gathered).

Evaluation runs under CP too, loss only (the logits are sharded over the CP ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from cpvlm.constants import IGNORE_INDEX
from cpvlm.hf.experts import num_experts
from cpvlm.loss import count_valid_labels, shift_labels
from cpvlm.options import CPOptions
from cpvlm.parallelize.gradients import clip_grad_norm_, global_grad_norm, sync_step_gradients
from cpvlm.parallelize.mesh import check_ep
from cpvlm.parallelize.mesh import check_tp as check_tp_size

_SEQ_KEYS = ("input_ids", "labels", "mm_token_type_ids", "token_type_ids")


def _fail(message: str):
    raise ValueError(f"ContextParallelTrainer: {message}")


def check_trainer_args(
    args, cp_size: int, world_size: int, compute_loss_func=None, *, ep: int = 1, tp: int = 1
) -> None:
    """Raise a ValueError naming the Trainer option that cannot work under cpvlm's CP (and its
    expert / tensor parallelism: ``ep``, ``tp``, checked as ``build_mesh`` checks them)."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        _fail(f"cp_size must be an int >= 1, got {cp_size!r}")
    where = "ContextParallelTrainer"
    tp = check_tp_size(tp, where=where)
    if world_size % (cp_size * tp):
        with_tp = f" x tp={tp}" if tp > 1 else ""
        _fail(
            f"the world size {world_size} is not divisible by cp_size={cp_size}{with_tp}; "
            f"launch dp x {cp_size * tp} processes (torchrun --nproc-per-node), or choose a "
            f"cp_size{with_tp and ' x tp'} that divides {world_size}"
        )
    check_tp_size(tp, check_ep(ep, world_size // (cp_size * tp), cp_size, where=where), where)
    if ep > 1 or tp > 1:
        sharded = f"ep={ep}" if ep > 1 else f"tp={tp}"
        _check_gradient_hooks(sharded)
        if getattr(args, "fsdp", None):
            _fail(
                f"{sharded} with fsdp: cpvlm sums the gradients of the sharded experts / layers "
                "itself, without a data-parallel wrapper (accelerate's FSDP2 would shard and "
                "average them over every rank); drop fsdp"
            )
        if str(getattr(args, "save_strategy", "no")) not in ("no", "SaveStrategy.NO"):
            _fail(
                f"checkpoints (save_strategy) with {sharded}: the Trainer would save rank 0's "
                "optimizer state, not the other ranks' shards; use save_strategy='no' "
                "(save_model() writes the whole model)"
            )
    pc = getattr(args, "parallelism_config", None)
    if pc is not None and any(getattr(pc, f"{k}_size", 1) > 1 for k in ("cp", "sp", "tp")):
        _fail(
            "TrainingArguments.parallelism_config sets accelerate's own cp/sp/tp size; cpvlm "
            "does the context parallelism (cp_size=...): leave parallelism_config=None"
        )
    problems = {
        "label_smoothing_factor": getattr(args, "label_smoothing_factor", 0) > 0,
        "deepspeed": bool(getattr(args, "deepspeed", None)),
        "fsdp with fsdp_config version 1 (use FSDP2: fsdp_config={'version': 2})": bool(
            getattr(args, "fsdp", None)
        )
        and int((getattr(args, "fsdp_config", None) or {}).get("version", 2)) != 2,
        "checkpoints (save_strategy) under fsdp (save_strategy='no'; save_model() writes the "
        "full model)": bool(getattr(args, "fsdp", None))
        and str(getattr(args, "save_strategy", "no")) not in ("no", "SaveStrategy.NO"),
        "n_gpu > 1 (torch DataParallel; launch with torchrun instead)": args.n_gpu > 1,
        "accelerator_config.dispatch_batches": bool(args.accelerator_config.dispatch_batches),
        "accelerator_config.split_batches": bool(args.accelerator_config.split_batches),
        "average_tokens_across_devices=False": not args.average_tokens_across_devices,
    }
    bad = [name for name, hit in problems.items() if hit]
    if compute_loss_func is not None:
        bad.append("compute_loss_func")
    if bad:
        _fail(
            f"{', '.join(bad)} cannot be used under cpvlm's CP: the loss is cpvlm's global token "
            "mean over sharded sequences (no label smoothing or custom loss), batches are "
            "sharded by DP rank in the data loader, and the data parallelism is DDP or "
            "accelerate's FSDP2 over dp x cp (drop the option)"
        )


# The Trainer methods that cpvlm overrides to sum and clip the gradients of sharded parameters
# (``ContextParallelTrainer.training_step`` and the two below): private ones, so a release that
# renames them would leave the Trainer clipping by this rank's norm alone, silently.
_GRADIENT_HOOKS = ("training_step", "_clip_grad_norm", "_get_grad_norm")


def _check_gradient_hooks(sharded: str) -> None:
    import transformers

    missing = [h for h in _GRADIENT_HOOKS if not callable(getattr(transformers.Trainer, h, None))]
    if missing:
        _fail(
            f"{sharded} needs transformers.Trainer.{', .'.join(missing)}, which transformers "
            f"{transformers.__version__} does not have (cpvlm sums and clips the sharded "
            "gradients there); use a transformers release inside cpvlm's tested window"
        )


def pack_rows(batch: dict) -> dict:
    """One packed row from a right-padded ``[B, S]`` batch: the rows' real tokens (its
    ``attention_mask``) in order, with ``doc_lens`` their lengths; vision inputs unchanged (their
    order is the rows' order)."""
    mask = batch.get("attention_mask")
    ids = batch["input_ids"]
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    lens = mask.sum(1)
    if not torch.equal(mask, torch.arange(ids.shape[1]) < lens[:, None]):
        _fail("pack=True needs right-padded batches (padding_side='right')")
    out = {k: v for k, v in batch.items() if k not in ("attention_mask", "position_ids")}
    for key in _SEQ_KEYS:
        if key in batch:
            out[key] = batch[key][mask].unsqueeze(0)
    out["doc_lens"] = lens[lens > 0]
    return out


def check_model_parallel(model, ep: int, tp: int) -> None:
    """``ep`` and ``tp`` can shard ``model`` (a ``PeftModel`` too), with the errors of ``cpvlm
    train``: EP needs a MoE model whose experts it divides; TP a plan that splits the decoder
    layers, sizes it divides, no MoE layers and no LoRA (PEFT wraps the planned layers)."""
    from cpvlm.hf.tensor_plan import check_tp
    from cpvlm.parallelize.expert_parallel import check_experts

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        check_experts(ep, num_experts(base), "ep")
        check_tp(tp, base, "tp")
    except ValueError as err:
        _fail(str(err))
    if tp > 1 and base is not model:
        _fail(f"tp = {tp} does not combine with LoRA (a PeftModel) yet; use tp 1")


class _LoggedShare(torch.autograd.Function):
    """``share * scale`` forward, the share's gradient backward: the Trainer logs the mean of the
    ranks' losses, while cpvlm sums the ranks' gradients itself (no DDP mean to undo)."""

    @staticmethod
    def forward(ctx, share, scale):
        return share * scale

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _PackingCollator:
    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        return pack_rows(self.collator(features))


def _float64_loss_sum(trainer):
    """A callback that sums the logged loss in float64 (Trainer's float32 sum would round the
    token mean to ~1e-7, hiding whether the CP loss is the one-process loss)."""
    from transformers import TrainerCallback

    class Float64LossSum(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            old = trainer._tr_loss
            trainer._tr_loss = old.to(torch.promote_types(old.dtype, torch.float64))

    return Float64LossSum()


class ContextParallelMixin:
    """Put before a ``transformers.Trainer`` class (``Trainer``, TRL's ``SFTTrainer``, ...).

    Keywords (besides the Trainer's own): ``cp_size`` (ranks per sequence; the world must be a
    multiple), ``cp_options`` (``cpvlm.options.CPOptions``: attention, vision mode, layout),
    ``pack`` (train on each collated batch packed into one row with per-document masks), ``ep``
    (expert parallelism: each MoE layer's experts sharded over groups of ``ep`` ranks of dp x cp)
    and ``tp`` (tensor parallelism: ``tp`` ranks per (dp, cp) coordinate split the decoder
    layers; the world is dp x cp x tp).
    """

    def __init__(
        self,
        *args,
        cp_size: int = 1,
        cp_options: CPOptions | None = None,
        pack=False,
        ep: int = 1,
        tp: int = 1,
        **kw,
    ):
        training_args = kw.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            check_trainer_args(
                training_args,
                cp_size,
                training_args.world_size,
                kw.get("compute_loss_func"),
                ep=ep,
                tp=tp,
            )
        self.cp_size, self.cp_options, self.cp_pack = cp_size, cp_options, pack
        self.cp_ep, self.cp_tp = ep, tp
        self._cp_runner = None
        self._cp_full_state = None
        super().__init__(*args, **kw)
        check_trainer_args(
            self.args, cp_size, self.args.world_size, self.compute_loss_func, ep=ep, tp=tp
        )
        check_model_parallel(self.model, ep, tp)
        if pack:
            self.data_collator = _PackingCollator(self.data_collator)
        self.loss_is_scaled_for_ga = True  # each share is divided by the step's global N
        self.add_callback(_float64_loss_sum(self))
        self._cp_setup_groups()
        self._cp_tp_summed = []
        if self._cp_sharded:  # before the optimizer takes the parameters
            self._cp_shard()

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        plugin_args = getattr(self.args, "fsdp_plugin_args", None)
        if plugin_args is not None and not self.is_fsdp_enabled:
            # accelerate engages its FSDP plugin on accelerators only (MULTI_GPU, ...): on CPU
            # (gloo) the same FSDP2 path, as accelerate sets it up there
            from accelerate.state import PartialState
            from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

            state = self.accelerator.state
            if state.distributed_type != DistributedType.MULTI_CPU:
                _fail(f"fsdp is set but accelerate runs {state.distributed_type}, not FSDP")
            state.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as accelerate
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**plugin_args)
            self.is_fsdp_enabled = True

    def _cp_setup_groups(self) -> None:
        from cpvlm.parallelize import build_mesh, mesh_groups

        if not dist.is_initialized():  # one process: a group of one for the CP wrapper
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        world = dist.get_world_size()
        cp, ep, tp = self.cp_size, self.cp_ep, self.cp_tp
        mesh = build_mesh(
            dp_shard=world // (cp * tp), cp=cp, ep=ep, tp=tp, device_type=self.args.device.type
        )
        self.cp_mesh, self.cp_groups = mesh, mesh_groups(mesh, ep=ep)

    @property
    def _cp_sharded(self) -> bool:
        """Expert or tensor parallelism: parameters sharded over other meshes, summed by cpvlm."""
        return self.cp_ep > 1 or self.cp_tp > 1

    def _cp_shard(self) -> None:
        """TP of the decoder layers, then ``ContextParallelVLM`` with its experts sharded over EP
        (``parallelize``, data parallelism "none"), in place: as ``cpvlm train`` sets them up."""
        from cpvlm.hf.context_parallel import ContextParallelVLM
        from cpvlm.hf.tensor_plan import apply_tensor_parallel
        from cpvlm.parallelize import parallelize

        model = self.model
        if hasattr(model, "get_base_model"):  # peft.PeftModel
            model = model.get_base_model()
        groups = self.cp_groups
        if groups.tp_mesh is not None:
            self._cp_tp_summed = apply_tensor_parallel(model, groups.tp_mesh)
        runner = ContextParallelVLM(model, groups.cp_group, options=self.cp_options)
        self._cp_runner = parallelize(runner, self.cp_mesh, data_parallel="none", groups=groups)

    # ---- model ----------------------------------------------------------------------------

    def _cp_model(self) -> nn.Module:
        """``ContextParallelVLM`` around the HF model (a PEFT model's base, LoRA layers in it),
        in DDP over every rank; built once."""
        if self._cp_runner is None:  # (with EP / TP: built by _cp_shard)
            from cpvlm.hf.context_parallel import ContextParallelVLM

            model = self.model
            if hasattr(model, "get_base_model"):  # peft.PeftModel
                model = model.get_base_model()
            groups = self.cp_groups
            runner = ContextParallelVLM(model, groups.cp_group, options=self.cp_options)
            if groups.sizes.world > 1:
                runner = nn.parallel.DistributedDataParallel(
                    runner,
                    process_group=groups.grad_sync_group,
                    find_unused_parameters=bool(self.args.ddp_find_unused_parameters),
                    broadcast_buffers=False,
                )
            self._cp_runner = runner
        return self._cp_runner

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self.is_fsdp_enabled:  # accelerate shards the HF model itself (see _cp_fsdp_forward)
            return model
        return self._cp_model()

    def _cp_fsdp_forward(self, model: nn.Module):
        """Under accelerate's FSDP2 (``fully_shard`` of the HF model's layers and of the model
        itself over every rank): ``ContextParallelVLM`` around the prepared model, its forward
        registered as an FSDP forward method of the root, so the root's parameters (embeddings,
        head, norm) are gathered around it as around ``model.forward``. FSDP2 averages the
        gradients over the world, as DDP does."""
        fwd = getattr(model, "_cpvlm_forward", None)
        if fwd is None:
            from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

            from cpvlm.hf.context_parallel import ContextParallelVLM

            if not isinstance(model, FSDPModule):
                _fail(f"fsdp is set but the model is a {type(model).__name__}, not FSDP2's")
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            runner = ContextParallelVLM(base, self.cp_groups.cp_group, options=self.cp_options)
            object.__setattr__(model, "_cpvlm_runner", runner)  # not a submodule of the model
            object.__setattr__(model, "_cpvlm_forward", runner.forward)
            register_fsdp_forward_method(model, "_cpvlm_forward")
            fwd = model._cpvlm_forward
        return fwd

    # ---- data -----------------------------------------------------------------------------

    def _get_dataloader(self, *args, **kwargs):
        """The Trainer's (accelerate's) loader, sharded over the DP replicas instead of over
        the processes: every CP rank of a replica gets its batches."""
        from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

        loader = super()._get_dataloader(*args, **kwargs)
        dp, dp_rank = self.cp_groups.sizes.dp, self.cp_groups.dp_rank
        shard = getattr(loader, "batch_sampler", None)
        if not isinstance(shard, BatchSamplerShard):
            shard = getattr(loader, "dataset", None)
        if isinstance(shard, (BatchSamplerShard, IterableDatasetShard)):
            shard.num_processes, shard.process_index = dp, dp_rank
        elif dist.get_world_size() > 1:
            _fail(
                f"the data loader is a {type(loader).__name__} that accelerate did not shard "
                "by batches; cpvlm shards BatchSamplerShard / IterableDatasetShard loaders"
            )
        return loader

    def _cp_count(self, batches: list) -> int:
        """N over the step's microbatches and DP replicas, shifted per packed document."""
        labels = [shift_labels(b["labels"], doc_lens=b.get("doc_lens")) for b in batches]
        group = self.cp_groups.dp_group if self.cp_groups.sizes.dp > 1 else None
        if not labels:  # a replica without batches still joins the count
            labels = [torch.full((1, 1), IGNORE_INDEX)]
        return count_valid_labels(labels, group)

    def _get_num_items_in_batch(self, batch_samples: list, device):
        return torch.tensor(self._cp_count(batch_samples), device=device)

    # ---- gradients (EP / TP) --------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        """With EP / TP, the step's gradients summed after its last microbatch's backward (where
        DDP would sync; accelerate says which: ``sync_gradients``)."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._cp_sharded and self.accelerator.sync_gradients:
            sync_step_gradients(self._cp_runner, self.cp_groups, "none", self._cp_tp_summed)
        return loss

    def _cp_trainable(self) -> list[nn.Parameter]:
        return [p for p in self._cp_runner.parameters() if p.requires_grad]

    def _clip_grad_norm(self, model):
        if not self._cp_sharded:
            return super()._clip_grad_norm(model)
        return clip_grad_norm_(self._cp_trainable(), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and self._cp_sharded:  # max_grad_norm = 0: the norm, unclipped
            grad_norm = global_grad_norm(self._cp_trainable())
        return super()._get_grad_norm(model, grad_norm)

    # ---- loss -----------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """This rank's share of the global token mean, times the world size (DDP averages the
        gradients over the world; the Trainer averages the logged losses over it). With EP / TP
        the value is ``share * dp * cp`` (the TP ranks of a share log it alike) and the gradient
        the share's (``sync_step_gradients`` sums)."""
        inputs = dict(inputs)
        for key in ("shift_labels", "position_ids", "seq_lengths", "num_items_in_batch"):
            inputs.pop(key, None)
        if num_items_in_batch is None:  # evaluation: this batch over the DP replicas
            num_items_in_batch = self._cp_count([inputs])
            batches = 1
        else:
            batches = self.current_gradient_accumulation_steps
        if self.is_fsdp_enabled:
            model = self._cp_fsdp_forward(model)
        out = model(
            **inputs,
            num_valid=int(num_items_in_batch),
            num_batches=batches * self.cp_groups.sizes.dp,
        )
        sizes = self.cp_groups.sizes
        if self._cp_sharded:
            loss = _LoggedShare.apply(out.loss, sizes.world // sizes.tp)
        else:
            loss = out.loss * sizes.world
        return (loss, {"loss": loss}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        self._cp_fsdp_reshard()
        return loss.detach(), None, None

    def _cp_fsdp_reshard(self) -> None:
        """Free FSDP2's gathered parameters (the root keeps them after a forward without a
        backward, and its full state dict must be gathered from the shards)."""
        if self.is_fsdp_enabled:
            from torch.distributed.fsdp import FSDPModule

            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def save_model(self, *args, **kwargs):
        self._cp_fsdp_reshard()
        if self._cp_sharded:  # the whole tensors of the EP / TP shards, on every rank (collective)
            self._cp_full_state = {
                k: v.full_tensor() if isinstance(v, DTensor) else v
                for k, v in self.model.state_dict().items()
            }
        try:
            return super().save_model(*args, **kwargs)
        finally:
            self._cp_full_state = None

    def _save(self, output_dir=None, state_dict=None):
        if state_dict is None:
            state_dict = self._cp_full_state
        return super()._save(output_dir, state_dict)


def _trainer_class():
    from transformers import Trainer

    class ContextParallelTrainer(ContextParallelMixin, Trainer):
        """``transformers.Trainer`` under cpvlm's CP: ``ContextParallelTrainer(..., cp_size=C)``."""

    return ContextParallelTrainer


def __getattr__(name: str):
    if name == "ContextParallelTrainer":  # transformers imported on first use only
        cls = _trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
