"""ContextParallelVLM: a transformers Qwen2.5-VL / Qwen3-VL model trained under context parallelism.

Legend: B batch, S full length, L = S_loc local length, D hidden size, V vocabulary, R visual rows.

Every CP rank passes the same full batch. The scalable flow (DESIGN section 3) never builds a
full-length float tensor: positions and labels are computed on the full integer sequence, then
each rank embeds its own tokens, gets the vision rows of its own visual positions (each image or
frame encoded once, on one rank, rows routed to their owners), runs the decoder on its shard with
CP attention, and returns its share of the global token-mean loss. The compatibility flow builds
the full ``inputs_embeds`` as the model itself would and cuts it with ``ShardPlan.shard``; it is
the reference the scalable flow is tested against. Nothing in transformers or torch is patched:
the attention is selected through transformers' AttentionInterface for the text model only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cpvlm.constants import ATTN_IMPLS, FLOWS, VISION_MODES
from cpvlm.distributed.shard_plan import pad_and_shard
from cpvlm.loss import IGNORE_INDEX, token_mean_loss
from cpvlm.vision import VisionDataParallel, VisionUnits, assign_vision_units

from .attention import CP_ATTENTION, CPAttentionContext
from .inputs import OPTIONAL_KEYS, PreparedBatch, prepare_batch
from .models import model_family
from .vision_cost import vision_cost


@dataclass
class ContextParallelOutput:
    """This rank's share of a step: summed over CP ranks, ``loss`` is the model's mean loss."""

    loss: torch.Tensor
    num_valid: int  # the global count the loss is divided by
    local_labels: int  # valid labels on this rank
    local_visual_tokens: int  # visual positions in this rank's shard
    encoded_units: int  # vision units (images, frames) this rank encoded


class _Tower(nn.Module):
    """``visual(pixel_values, grid_thw)`` as VisionDataParallel expects: rows, or (rows, deepstack)."""

    def __init__(self, visual: nn.Module, deepstack: bool):
        super().__init__()
        self.visual = visual
        self.deepstack = deepstack

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        out = self.visual(pixel_values, grid_thw=grid_thw, return_dict=True)
        if self.deepstack:
            return out.pooler_output, list(out.deepstack_features)
        return out.pooler_output


def _local_row_order(prep: PreparedBatch, cp_rank: int) -> torch.Tensor:
    """Indices of the visual rows this rank owns, sorted by their place in its [B, L] shard."""
    owner, local = prep.plan.locate(prep.row_positions)
    mine = torch.nonzero(owner == cp_rank).squeeze(1)
    return mine[torch.argsort(local[mine])]


class ContextParallelVLM(nn.Module):
    """Wrap a Qwen-VL ``*ForConditionalGeneration`` model for training on a CP group.

    Args:
        model: ``Qwen2_5_VLForConditionalGeneration`` or ``Qwen3VLForConditionalGeneration``.
        cp_group: the CP process group (``None``: the default group).
        attn: ``"ring"`` or ``"allgather"`` CP attention.
        vision: ``"route"`` (each unit encoded once, rows sent to their owners), ``"allgather"``
            (each unit encoded once, every rank gets every row) or ``"replicate"`` (every rank
            encodes every unit: the simple baseline).
        flow: ``"scalable"`` or ``"compat"`` (full ``inputs_embeds`` built, then sharded).

    ``forward(**batch)`` takes the same full batch on every CP rank and returns a
    ``ContextParallelOutput`` whose ``loss`` is this rank's share. With ``local_pixels=True``
    the pixel values (images, then videos) hold only the rows of the units this rank encodes,
    ``vision_assignment(units)[cp_rank]``, in unit order: a loader then decodes each image and
    frame once per CP group (not with ``vision="replicate"``, which encodes every unit).
    """

    def __init__(
        self,
        model: nn.Module,
        cp_group: dist.ProcessGroup | None = None,
        *,
        attn: str = "ring",
        vision: str = "route",
        flow: str = "scalable",
    ):
        super().__init__()
        self.family = model_family(model)
        for name, value, allowed in (
            ("attn", attn, ATTN_IMPLS),
            ("vision", vision, VISION_MODES),
            ("flow", flow, FLOWS),
        ):
            if value not in allowed:
                raise ValueError(
                    f"ContextParallelVLM: {name} must be one of {allowed}, got {value!r}"
                )
        if flow == "compat" and vision == "route":
            raise ValueError(
                "ContextParallelVLM: flow='compat' builds the full inputs_embeds, which needs every "
                "visual row on every rank: use vision='allgather' or 'replicate'"
            )
        self.model = model
        self.cp_group = cp_group
        self.attn, self.vision, self.flow = attn, vision, flow
        self.cp_size = dist.get_world_size(cp_group)
        self.cp_rank = dist.get_rank(cp_group)
        self.vision_cost = vision_cost(model)  # units balanced by the tower's modelled cost
        model.model.language_model.set_attn_implementation(CP_ATTENTION)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        num_valid: int | None = None,
        doc_lens=None,
        local_pixels: bool = False,
        **batch,
    ) -> ContextParallelOutput:
        unknown = set(batch) - set(OPTIONAL_KEYS)
        if unknown:
            raise ValueError(f"ContextParallelVLM: unexpected batch keys {sorted(unknown)}")
        if local_pixels and self.vision == "replicate":
            raise ValueError(
                "ContextParallelVLM: vision='replicate' encodes every unit on every rank and "
                "needs every pixel row; pass the full pixel values (local_pixels=False)"
            )
        prep = prepare_batch(
            self.model,
            {"input_ids": input_ids, "labels": labels, **batch},
            self.cp_size,
            doc_lens=doc_lens,
            num_valid=num_valid,
            local_pixels=local_pixels,
        )
        local = pad_and_shard(
            {
                "input_ids": prep.input_ids,
                "labels": prep.labels,
                "position_ids": prep.position_ids,
                "visual_mask": prep.visual_mask,
            },
            prep.plan,
            self.cp_rank,
            seq_dims={"visual_mask": 1},
        )
        visual_mask_loc = local["visual_mask"]
        x_loc, deepstack, encoded = self._local_embeddings(
            prep, local["input_ids"], visual_mask_loc
        )
        lm_kwargs = {}
        if self.family == "qwen3_vl":
            lm_kwargs = {"visual_pos_masks": visual_mask_loc, "deepstack_visual_embeds": deepstack}
        context = CPAttentionContext(prep.plan, self.cp_rank, self.cp_group, self.attn)
        hidden = self.model.model.language_model(
            inputs_embeds=x_loc,
            position_ids=local["position_ids"],
            attention_mask=None,
            use_cache=False,
            cpvlm_cp=context,
            **lm_kwargs,
        ).last_hidden_state
        logits = self.model.lm_head(hidden)
        loss = token_mean_loss(logits, local["labels"], prep.num_valid)
        return ContextParallelOutput(
            loss=loss,
            num_valid=prep.num_valid,
            local_labels=int((local["labels"] != IGNORE_INDEX).sum()),
            local_visual_tokens=int(visual_mask_loc.sum()),
            encoded_units=encoded,
        )

    def vision_assignment(self, units: VisionUnits) -> list[list[int]]:
        """The units each CP rank encodes: ``VisionDataParallel``'s assignment, balanced by the
        tower's modelled cost (a loader that decodes only this rank's units must use this one)."""
        return assign_vision_units(self.vision_cost.unit_costs(units), self.cp_size)

    def _local_embeddings(self, prep: PreparedBatch, ids_loc, visual_mask_loc):
        """``(inputs_embeds [B, L, D], deepstack rows of the local visual positions, units)``.

        In a method so that the compat flow's full-length tensors die when it returns, before the
        decoder runs (autograd keeps only their indices).
        """
        rows, encoded = self._vision_rows(prep)
        embed = self.model.get_input_embeddings()
        if self.flow == "scalable":
            x_loc = embed(ids_loc)
            x_loc = x_loc.masked_scatter(visual_mask_loc.unsqueeze(-1), rows[0].to(x_loc.dtype))
            return x_loc, rows[1:], encoded
        x_full = embed(prep.input_ids)
        # masked_scatter fills positions in row-major order; rows are images then videos.
        order = torch.argsort(prep.row_positions).to(x_full.device)
        x_full = x_full.masked_scatter(
            prep.visual_mask.unsqueeze(-1), rows[0].index_select(0, order).to(x_full.dtype)
        )
        mine = _local_row_order(prep, self.cp_rank).to(x_full.device)
        deepstack = [t.index_select(0, mine) for t in rows[1:]]
        return prep.plan.shard(prep.plan.pad(x_full), self.cp_rank), deepstack, encoded

    def _vision_rows(self, prep: PreparedBatch) -> tuple[list[torch.Tensor], int]:
        """This rank's visual rows (scalable flow) or all of them (compat), main then deepstack.

        The tower runs on every rank even without images (VisionDataParallel then encodes a dummy
        frame and keeps none of it), so every rank makes the same collectives and gradients.
        """
        visual = self.model.model.visual
        tower = _Tower(visual, deepstack=self.family == "qwen3_vl")
        # Text-only batches give [0, C] pixels: the tower still runs (on a dummy frame) on every
        # rank, so FSDP's per-module collectives and the set of gradients match across DP ranks.
        pixel_values = prep.pixel_values(visual.dtype)
        if self.vision == "replicate" and len(prep.grid_thw):
            out = tower(pixel_values, prep.grid_thw)
            encoded = int(prep.grid_thw[:, 0].sum())
        else:
            # With no units at all, "replicate" runs the same dummy frame as the other modes.
            mode = "allgather" if self.vision == "replicate" else self.vision
            vdp = VisionDataParallel(
                tower,
                self.cp_group,
                mode=mode,
                merge_size=visual.spatial_merge_size,
                cost=self.vision_cost,
            )
            encoded = len(vdp.assignment(vdp.units(prep.grid_thw))[self.cp_rank])
            if mode == "route":
                out = vdp(
                    pixel_values,
                    prep.grid_thw,
                    plan=prep.plan,
                    row_positions=prep.row_positions,
                    local_pixels=prep.local_pixels,
                )
            else:
                out = vdp(pixel_values, prep.grid_thw, local_pixels=prep.local_pixels)
        rows = [out[0], *out[1]] if isinstance(out, tuple) else [out]
        if self.flow == "scalable" and self.vision != "route":
            mine = _local_row_order(prep, self.cp_rank).to(rows[0].device)
            rows = [t.index_select(0, mine) for t in rows]
        return rows, encoded
