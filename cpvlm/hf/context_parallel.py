"""ContextParallelVLM: a transformers VLM trained under context parallelism, any supported family.

Legend: B batch, S full length, L = S_loc local length, D hidden size, V vocabulary, R visual rows.

Every CP rank passes the same full batch. The scalable flow (docs/architecture.md, "One training
step") never builds a full-length float tensor: positions and labels are computed on the full
integer sequence, then each rank embeds its own tokens, gets the vision rows of its own visual
positions (each image or frame encoded once, on one rank, rows routed to their owners; audio
clips likewise, through the audio encoder's own ``EncoderDataParallel``), runs the
decoder on its shard with CP attention, and returns its share of the global token-mean loss (plus
its share of the model's extra losses, such as an MoE router's load-balancing loss). The
compatibility flow builds the full ``inputs_embeds`` as the model itself would and cuts it with
``ShardPlan.shard``; it is the reference the scalable flow is tested against. Nothing in
transformers or torch is patched: the attention is selected through transformers' AttentionInterface
for the text model only. What is particular to a family (module paths, tower call, positions,
decoder keywords, extra losses) comes from its adapter (``cpvlm.hf.adapter``).

Extra losses are defined per forward batch, as transformers defines them (its MoE models compute
the router loss over the rows given to one forward call). A training step of several microbatches
and DP replicas averages them over its ``num_batches`` forward batches, so that with the token-mean
cross-entropy the summed gradients are those of the one-device run of the same forward batches:
``loss = CE / N + sum_f sum_extra weight * aux_f / num_batches``. (A step-wide router
statistic would need every microbatch's forward before the first backward.)

Agreement (docs/architecture.md, "Collective discipline"): what every collective of a forward
depends on (the plan, a fingerprint of the batch) is agreed by the first of them, one small
all-reduce after the vision tower, together with the facts only one rank knows (its tower's output
rows); the decoder layers' ``cp_attention`` then skips it. A rank that finds its own batch invalid
(CP ranks handed different batches) follows the others through the tower to that agreement, so every
rank raises its error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from cpvlm.attention import hybrid_groups
from cpvlm.constants import IGNORE_INDEX, VISION_MODES
from cpvlm.distributed.collectives import StepAgreement, agree, fingerprint
from cpvlm.distributed.shard_plan import pad_and_shard
from cpvlm.encoders import EncoderDataParallel, EncoderUnits
from cpvlm.hf.adapter import VLMAdapter
from cpvlm.hf.attention import CP_ATTENTION, CPAttentionContext, cp_forward
from cpvlm.hf.inputs import PreparedBatch, batch_keys, prepare_batch
from cpvlm.hf.registry import adapter_for
from cpvlm.hf.vision_attention import SplitTower
from cpvlm.loss import chunked_token_mean_loss, token_mean_loss
from cpvlm.options import CPOptions
from cpvlm.router_loss import load_balancing_loss_share


@dataclass
class ContextParallelOutput:
    """This rank's share of a step: summed over CP ranks, ``loss`` is the model's mean loss."""

    loss: torch.Tensor
    num_valid: int  # the global count the loss is divided by
    local_labels: int  # valid labels on this rank
    local_visual_tokens: int  # visual positions in this rank's shard
    encoded_units: int  # vision units (images, frames) this rank encoded
    encoded_audio: int = 0  # audio clips this rank encoded
    attn_impl: str = ""  # the CP attention that ran ("ring", "hybrid 2x2", ...; auto: its pick)
    extra_losses: dict[str, torch.Tensor] = field(default_factory=dict)  # shares, unweighted


class TowerCall:
    """``encoder(pixel_values, grid_thw, kinds=)`` as EncoderDataParallel calls it: the adapter's
    ``encode`` on the model. A plain callable, not a module, so the tower's parameters keep one owner (the
    model) in ``state_dict`` and FSDP."""

    def __init__(self, adapter: VLMAdapter, model: nn.Module):
        self.adapter, self.model = adapter, model

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, kinds=None):
        return self.adapter.encode(self.model, pixel_values, grid_thw, kinds=kinds)


class AudioCall:
    """``encoder(features, grid, kinds=)`` as the audio EncoderDataParallel calls it: the
    adapter's ``encode_audio`` on clips of grid (1, 1, frames). A plain callable (``TowerCall``)."""

    def __init__(self, adapter: VLMAdapter, model: nn.Module):
        self.adapter, self.model = adapter, model
        self.batch_lengths: tuple[int, ...] = ()  # the forward batch's clips, set per forward

    def __call__(self, features: torch.Tensor, grid_thw: torch.Tensor, kinds=None):
        lengths = grid_thw[:, 2]
        return self.adapter.encode_audio(self.model, features, lengths, self.batch_lengths)


def audio_data_parallel(
    adapter: VLMAdapter, model: nn.Module, group, vision: str
) -> EncoderDataParallel | None:
    """The audio encoder's data parallelism over the CP group (None: the model has no audio
    encoder): each clip one unit of grid (1, 1, frames), encoded once, balanced by the adapter's
    ``audio_cost``, rows routed to their owners (all-gathered under ``vision="allgather"`` or
    ``"replicate"``)."""
    if adapter.audio_tower(model) is None:
        return None
    return EncoderDataParallel(
        AudioCall(adapter, model),
        group,
        mode="allgather" if vision in ("allgather", "replicate") else "route",
        merge_size=1,
        split_frames=False,
        cost=adapter.audio_cost(),
        unit_sizes=lambda grid, kind: (grid[2], adapter.audio_rows(grid[2])),
        dummy_unit=((1, 1, adapter.audio_dummy_frames), "audio"),
    )


def _local_row_order(prep: PreparedBatch, cp_rank: int, row_positions=None) -> torch.Tensor:
    """Indices of the visual rows (or of ``row_positions``' rows) this rank owns, sorted by their
    place in its [B, L] shard."""
    rows = prep.row_positions if row_positions is None else row_positions
    owner, local = prep.plan.locate(rows)
    mine = torch.nonzero(owner == cp_rank).squeeze(1)
    return mine[torch.argsort(local[mine])]


def _as_rows(out) -> list[torch.Tensor]:
    return [out[0], *out[1]] if isinstance(out, tuple) else [out]


def _softcapped_loss(head, hidden, labels_loc, num_valid: int, cap: float, chunk: int | None):
    """The token-mean loss of ``cap * tanh(head(hidden) / cap)``; with ``chunk``, ``chunk`` rows
    of logits at a time, each chunk recomputed in the backward (activation checkpointing), so no
    rank holds ``[L, V]`` logits."""

    def loss_of(h, labels):
        return token_mean_loss(torch.tanh(head(h) / cap) * cap, labels, num_valid)

    if not chunk:
        return loss_of(hidden, labels_loc)
    h, labels = hidden.reshape(-1, hidden.shape[-1]), labels_loc.reshape(-1)
    parts = [
        checkpoint(loss_of, h[a : a + chunk], labels[a : a + chunk], use_reentrant=False)
        for a in range(0, h.shape[0], chunk)
    ]
    return torch.stack(parts).sum()


def _options(options: CPOptions | None, cp_size: int) -> CPOptions:
    """``options`` (default ``CPOptions()``) with the group's ``cp_size``, validated; a ValueError
    names the field and the fix."""
    options = CPOptions() if options is None else options
    if not isinstance(options, CPOptions):
        raise ValueError(
            f"ContextParallelVLM: options must be a cpvlm.options.CPOptions, got "
            f"{type(options).__name__}"
        )
    if options.cp_size not in (None, cp_size):
        raise ValueError(
            f"ContextParallelVLM: options.cp_size={options.cp_size} but the CP group has "
            f"{cp_size} ranks; build the options with cp_size={cp_size} (or None)"
        )
    try:
        return options.replace(cp_size=cp_size)
    except ValueError as err:
        raise ValueError(f"ContextParallelVLM: {err}") from None


@dataclass(frozen=True)
class RowGroup:
    """What a forward on one CP group uses: the group, its size, this rank's place in it, the
    options at that size, and the encoders' data parallelism over it (``ContextParallelVLM``
    keeps one per row CP size, ``row_groups``)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    options: CPOptions
    vision_dp: EncoderDataParallel
    audio_dp: EncoderDataParallel | None


class ContextParallelVLM(nn.Module):
    """Wrap a transformers VLM (``*ForConditionalGeneration`` of a supported family) for training
    on a CP group.

    Args:
        model: the model; ``cpvlm.hf.supported()`` lists the classes.
        cp_group: the CP process group (``None``: the default group).
        options: the CP options (``cpvlm.options.CPOptions``; default ``CPOptions()``), checked
            by ``CPOptions`` as everywhere else; its ``cp_size``, if set, must be the group's
            size. ``options.attn``: CP attention: ``"ring"``, ``"allgather"``, ``"ulysses"``,
            ``"hybrid"`` (with ``ulysses_size``, ranks per Ulysses group, a divisor of the CP
            size) or ``"auto"`` (see ``cpvlm.cp_attention``); every family.
            ``options.vision``: ``"route"`` (each unit encoded once, rows sent to their owners),
            ``"allgather"`` (each unit encoded once, every rank gets every row), ``"split"`` (as
            route, units larger than a rank's share sharded across ranks, the tower
            sequence-parallel on them, its attention through ``attn``; families with
            ``adapter.split_vision``) or ``"replicate"`` (every rank encodes every unit: the
            simple baseline). ``options.flow``: ``"scalable"`` or ``"compat"`` (full
            ``inputs_embeds`` built, then sharded). ``options.layout``: ``ShardPlan`` layout,
            ``"head_tail"`` (the default) or ``"balanced"`` (short packed documents whole on one
            rank; not for linear-attention families).
        loss_chunk: compute the loss ``loss_chunk`` rows at a time from the final hidden states
            (``cpvlm.loss.chunked_token_mean_loss``: the same loss and gradients, no
            ``[S_loc, V]`` logits); ``None``: the whole local logits at once.
        row_groups: dynamic CP (``docs/training.md``, "Dynamic CP"): ``{c: group}``, this rank's
            group of ``c`` ranks for each smaller row CP size ``c`` it may run a row on (each a
            divisor of the CP size, made once, collectively: ``cpvlm.parallelize.row_groups``);
            ``forward(..., cp_size=c)`` then runs the row on that group. Every collective of
            the forward (sharding, agreement, attention, linear-attention state passing, vision
            and audio routing, router statistics) follows it; the module and its parameters are
            the same. Not with ``attn="hybrid"``.

    ``forward(**batch)`` takes the same full batch on every CP rank and returns a
    ``ContextParallelOutput`` whose ``loss`` is this rank's share. With ``local_pixels=True``
    the pixel values (images, then videos; the core's pixel rows) hold only the rows of the
    units this rank encodes, ``vision_assignment(units)[cp_rank]``, in unit order: a loader then
    decodes each image and frame once per CP group (``vision="split"``: a sharded unit on each
    rank that holds a piece of it; not with ``vision="replicate"``, which encodes every unit).
    """

    def __init__(
        self,
        model: nn.Module,
        cp_group: dist.ProcessGroup | None = None,
        *,
        options: CPOptions | None = None,
        loss_chunk: int | None = None,
        row_groups: Mapping[int, dist.ProcessGroup] | None = None,
    ):
        super().__init__()
        self.adapter = adapter_for(model)
        self.family = self.adapter.family
        self.options = options = _options(options, dist.get_world_size(cp_group))
        attn, vision, flow = options.attn, options.vision, options.flow
        if vision == "split" and not self.adapter.split_vision:
            modes = [m for m in VISION_MODES if m != "split"]
            raise ValueError(
                f"ContextParallelVLM: vision='split' is not supported for {self.family} (its "
                f"tower cannot run on part of an image); supported vision modes: {modes}"
            )
        if loss_chunk is not None and (
            isinstance(loss_chunk, bool) or not isinstance(loss_chunk, int) or loss_chunk < 1
        ):
            raise ValueError(
                f"ContextParallelVLM: loss_chunk must be None or an int >= 1, got {loss_chunk!r}"
            )
        self.loss_chunk = loss_chunk
        self.model = model
        self.cp_group = cp_group
        self.attn, self.vision, self.flow = attn, vision, flow
        self.ulysses_size, self.layout = options.ulysses_size, options.layout
        self.cp_size = options.cp_size
        self.cp_rank = dist.get_rank(cp_group)
        if attn == "hybrid":  # created now, on every rank, not mid-forward
            hybrid_groups(cp_group, options.ulysses_size)
        self.adapter.text_model(model).set_attn_implementation(CP_ATTENTION)
        self.adapter.install_context_parallel(model)
        self.encode = TowerCall(self.adapter, model)
        self.vision_cost = self.adapter.vision_cost()  # units balanced by the tower's cost
        # "replicate" with no units at all runs the same dummy frame as the other modes.
        self.vision_dp = self._vision_data_parallel(cp_group, options, model)
        self.audio_dp = audio_data_parallel(self.adapter, model, cp_group, vision)
        self.batch_keys = batch_keys(self.adapter)
        full = RowGroup(
            cp_group, self.cp_size, self.cp_rank, options, self.vision_dp, self.audio_dp
        )
        # A plain dict: the other sizes' encoders hold no parameters and stay out of the
        # module tree (state_dict, FSDP units are the static model's).
        self._row_groups = {self.cp_size: full, **self._more_row_groups(row_groups or {})}
        self._row = full  # the group of the forward under way

    def _vision_data_parallel(self, group, options: CPOptions, model) -> EncoderDataParallel:
        vision = options.vision
        split = {}
        if vision == "split":  # the tower's attention: SDPA per unit, cp_attention when sharded
            split = {"attention": options.attention}
        return EncoderDataParallel(
            SplitTower(self.adapter, model) if vision == "split" else self.encode,
            group,
            mode="allgather" if vision == "replicate" else vision,
            merge_size=self.adapter.merge_size,
            split_frames=self.adapter.split_frames,
            cost=self.vision_cost,
            # split cuts units by patches: its families have the default item sizes
            unit_sizes=None if vision == "split" else self.adapter.item_sizes,
            **split,
        )

    def _more_row_groups(self, row_groups: Mapping[int, dist.ProcessGroup]) -> dict:
        """``RowGroup`` of each of ``row_groups``, checked: sizes that divide the CP size, groups
        of that size holding this rank."""
        if row_groups and self.attn == "hybrid":
            raise ValueError(
                "ContextParallelVLM: row_groups (dynamic CP) cannot run attn='hybrid' (its "
                "Ulysses size need not divide a row's CP size); use ring, allgather or ulysses"
            )
        out = {}
        for c, group in sorted(row_groups.items()):
            if isinstance(c, bool) or not isinstance(c, int) or c < 1 or self.cp_size % c:
                raise ValueError(
                    f"ContextParallelVLM: row_groups size {c!r} does not divide the CP size "
                    f"{self.cp_size}"
                )
            if dist.get_world_size(group) != c or dist.get_rank(group) < 0:
                raise ValueError(
                    f"ContextParallelVLM: row_groups[{c}] must be a group of {c} ranks holding "
                    f"this rank; got {dist.get_world_size(group)} ranks"
                )
            if c == self.cp_size:
                continue
            options = self.options.replace(cp_size=c)
            out[c] = RowGroup(
                group,
                c,
                dist.get_rank(group),
                options,
                self._vision_data_parallel(group, options, self.model),
                audio_data_parallel(self.adapter, self.model, group, self.vision),
            )
        return out

    @property
    def row_sizes(self) -> list[int]:
        """The CP sizes ``forward(cp_size=)`` can run a row at (the CP size and ``row_groups``)."""
        return sorted(self._row_groups)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        num_valid: int | None = None,
        doc_lens=None,
        num_batches: int = 1,
        local_pixels: bool = False,
        cp_size: int | None = None,
        **batch,
    ) -> ContextParallelOutput:
        """One forward batch. ``num_valid``: the step's global count of valid shifted labels
        (default: this batch's); ``num_batches``: the step's forward batches (microbatches x DP
        replicas) that per-batch extra losses are averaged over; ``cp_size``: the CP size to run
        it at (default: the CP group's; a smaller one of ``row_sizes``: on this rank's group of
        that size, the same batch on each of its ranks)."""
        self._check_call(batch, num_batches, local_pixels, cp_size)
        row = self._row = self._row_groups[self.cp_size if cp_size is None else cp_size]
        # The record_function ranges name the phases in a torch.profiler trace (nothing when
        # no profiler runs): benchmarks/train.py --part profile reads them.
        with record_function("cpvlm.prepare"):
            try:
                prep = prepare_batch(
                    self.model,
                    {"input_ids": input_ids, "labels": labels, **batch},
                    row.size,
                    doc_lens=doc_lens,
                    num_valid=num_valid,
                    layout=self.layout,
                    adapter=self.adapter,
                    local_pixels=local_pixels,
                )
            except ValueError as err:
                self._join_failed_step(str(err))
                raise
            audio = {} if prep.audio_mask is None else {"audio_mask": prep.audio_mask}
            local = pad_and_shard(
                {
                    "input_ids": prep.input_ids,
                    "labels": prep.labels,
                    "position_ids": prep.position_ids,
                    "visual_mask": prep.visual_mask,
                    "real_mask": prep.real_mask,
                    **audio,
                },
                prep.plan,
                row.rank,
                seq_dims={"visual_mask": 1, "real_mask": 1, "audio_mask": 1},
            )
        visual_mask_loc = local["visual_mask"]
        step = StepAgreement(
            {
                "plan": (prep.plan.cp_size, prep.plan.doc_lens),
                "batch": fingerprint(
                    prep.input_ids,
                    prep.labels,
                    prep.grid_thw,
                    prep.kinds,
                    prep.num_valid,
                    prep.audio_lengths,
                ),
            }
        )
        x_loc, deepstack, encoded, encoded_audio = self._local_embeddings(
            prep, local["input_ids"], visual_mask_loc, local.get("audio_mask"), step
        )
        context = CPAttentionContext(
            prep.plan,
            row.group,
            row.options.attention,
            step=step,
            spans=prep.spans,
            span_layers=self.adapter.span_layers,
        )
        with record_function("cpvlm.decoder"), cp_forward():
            decoder_out = self.adapter.text_model(self.model)(
                inputs_embeds=x_loc,
                position_ids=local["position_ids"],
                attention_mask=None,
                use_cache=False,
                cpvlm_cp=context,
                **self.adapter.decoder_inputs(
                    self.model, local["input_ids"], visual_mask_loc, deepstack
                ),
            )
        with record_function("cpvlm.loss"):
            loss = self._loss(decoder_out.last_hidden_state, local["labels"], prep.num_valid)
            extras = {}
            router = self.adapter.router_loss()
            if router is not None:  # this rank's share, from statistics summed over the CP group
                extras["router_aux"] = load_balancing_loss_share(
                    decoder_out.router_logits,
                    local["real_mask"],
                    top_k=router.top_k,
                    group=row.group,
                )
                loss = loss + extras["router_aux"] * (router.weight / num_batches)
        return ContextParallelOutput(
            loss=loss,
            num_valid=prep.num_valid,
            local_labels=int((local["labels"] != IGNORE_INDEX).sum()),
            local_visual_tokens=int(visual_mask_loc.sum()),
            encoded_units=encoded,
            encoded_audio=encoded_audio,
            attn_impl=",".join(sorted(context.ran)),
            extra_losses=extras,
        )

    def _check_call(self, batch, num_batches, local_pixels, cp_size) -> None:
        """The forward's own arguments (the batch itself is checked by ``prepare_batch``)."""
        if cp_size is not None and cp_size not in self._row_groups:
            raise ValueError(
                f"ContextParallelVLM: cp_size={cp_size!r} is not one of this module's row CP "
                f"sizes {self.row_sizes} (the CP size, and those of row_groups)"
            )
        unknown = set(batch) - set(self.batch_keys)
        if unknown:
            raise ValueError(
                f"ContextParallelVLM: unexpected batch keys {sorted(unknown)} for "
                f"{self.family} (known: {list(self.batch_keys)})"
            )
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
            raise ValueError(
                f"ContextParallelVLM: num_batches must be an int >= 1, got {num_batches!r}"
            )
        if local_pixels and self.vision == "replicate":
            raise ValueError(
                "ContextParallelVLM: vision='replicate' encodes every unit on every rank and "
                "needs every pixel row; pass the full pixel values (local_pixels=False)"
            )

    def _loss(self, hidden: torch.Tensor, labels_loc: torch.Tensor, num_valid: int):
        head = self.adapter.lm_head(self.model)
        cap = self.adapter.logit_softcap
        if cap is not None:  # the model's own cap * tanh(logits / cap)
            return _softcapped_loss(head, hidden, labels_loc, num_valid, cap, self.loss_chunk)
        if not self.loss_chunk:
            return token_mean_loss(head(hidden), labels_loc, num_valid)
        return chunked_token_mean_loss(
            hidden,
            head.weight,
            labels_loc,
            num_valid,
            bias=head.bias,
            chunk_size=self.loss_chunk,
        )

    def _join_failed_step(self, error: str) -> None:
        """Raise ``error`` on every CP rank, from a rank whose batch alone was invalid.

        CP ranks handed different batches find the problem on some ranks only, and the others go
        on into the tower (under FSDP2: its parameter all-gather) and the step's agreement. This
        rank follows them as far as that agreement with a text-only stand-in batch, whose path
        makes the same collectives in the same order: the tower once, on a dummy frame, then the
        agreement, which carries the error to every rank.
        """
        step = StepAgreement()
        step.fail(error)
        n = 2 * self._row.size
        text = next(t for t in range(8) if t not in self.adapter.special_token_ids)
        stand_in = prepare_batch(
            self.model,
            {
                "input_ids": torch.full((1, n), text, dtype=torch.long),
                "labels": torch.full((1, n), IGNORE_INDEX, dtype=torch.long),
            },
            self._row.size,
            adapter=self.adapter,
        )
        self._vision_rows(stand_in, step)

    def vision_assignment(self, units: EncoderUnits, cp_size: int | None = None) -> list[list[int]]:
        """The units whose pixels each CP rank reads, ascending: those it encodes,
        ``EncoderDataParallel``'s assignment balanced by the tower's modelled cost, and under
        ``vision="split"`` the units it holds pieces of (a loader that decodes only this rank's
        units must use this one). ``cp_size``: of each rank of a group of that size
        (``row_groups``), for a row run at that size."""
        size = self.cp_size if cp_size is None else cp_size
        return self._row_groups[size].vision_dp.pixel_assignment(units)

    def vision_pieces(self, units: EncoderUnits) -> list[dict[int, tuple[int, ...]]]:
        """Per CP rank, ``{unit: merge groups}`` of the sharded units it holds a piece of
        (``vision="split"``; else none): a loader may decode only those groups' pixel rows."""
        return self.vision_dp.pixel_pieces(units)

    def _local_embeddings(
        self, prep: PreparedBatch, ids_loc, visual_mask_loc, audio_mask_loc, step
    ):
        """``(inputs_embeds [B, L, D], deepstack rows of the local visual positions, vision units,
        audio clips encoded here)``.

        In a method so that the compat flow's full-length tensors die when it returns, before the
        decoder runs (autograd keeps only their indices).
        """
        with record_function("cpvlm.vision"):
            rows, encoded = self._vision_rows(prep, step)
        with record_function("cpvlm.audio"):
            audio, encoded_audio = self._audio_rows(prep, step)
        embed = self.adapter.embed_tokens(self.model)
        if self.flow == "scalable":
            x_loc = embed(ids_loc)
            x_loc = x_loc.masked_scatter(visual_mask_loc.unsqueeze(-1), rows[0].to(x_loc.dtype))
            if audio_mask_loc is not None:
                x_loc = x_loc.masked_scatter(audio_mask_loc.unsqueeze(-1), audio.to(x_loc.dtype))
            return x_loc, rows[1:], encoded, encoded_audio
        x_full = embed(prep.input_ids)
        # masked_scatter fills positions in row-major order; rows are images then videos.
        order = torch.argsort(prep.row_positions).to(x_full.device)
        x_full = x_full.masked_scatter(
            prep.visual_mask.unsqueeze(-1), rows[0].index_select(0, order).to(x_full.dtype)
        )
        if prep.audio_mask is not None:
            order = torch.argsort(prep.audio_row_positions).to(x_full.device)
            x_full = x_full.masked_scatter(
                prep.audio_mask.unsqueeze(-1), audio.index_select(0, order).to(x_full.dtype)
            )
        mine = _local_row_order(prep, self._row.rank).to(x_full.device)
        deepstack = [t.index_select(0, mine) for t in rows[1:]]
        x_loc = prep.plan.shard(prep.plan.pad(x_full), self._row.rank)
        return x_loc, deepstack, encoded, encoded_audio

    def _audio_rows(self, prep: PreparedBatch, step: StepAgreement):
        """``(rows, clips encoded here)``: this rank's audio rows in its shard's order (scalable
        flow) or every clip's rows in clip order (compat); None without an audio encoder. The
        audio tower runs on every rank, on a dummy clip where it has none (as the vision tower)."""
        audio_dp, vision_dp = self._row.audio_dp, self._row.vision_dp
        if audio_dp is None:
            return None, 0
        dtype = next(self.adapter.audio_tower(self.model).parameters()).dtype
        n = len(prep.audio_lengths)
        width = self.adapter.audio_feature_width
        features = prep.audio_features.to(dtype) if n else torch.zeros(0, width, dtype=dtype)
        audio_dp.encoder.batch_lengths = prep.audio_lengths
        routed = audio_dp.mode == "route"  # scalable only (compat needs every row)
        empty = torch.zeros(0, dtype=torch.long)
        positions = prep.audio_row_positions if n else empty
        route = {"plan": prep.plan, "row_positions": positions} if routed else {}
        base = None
        if n and self.vision in ("route", "allgather") and len(prep.grid_thw):
            # Clips balance around the vision units' modelled cost per rank (both in MACs), so
            # that the two encoders' heaviest units do not meet on one rank.
            base = vision_dp.rank_loads(vision_dp.units(prep.grid_thw, prep.kinds))
        rows, encoded = audio_dp(
            features,
            prep.audio_grid,
            kinds=("audio",) * n,
            with_unit_count=True,
            step=step,
            base_loads=base,
            **route,
        )
        if self.flow == "scalable" and not routed and n:
            mine = _local_row_order(prep, self._row.rank, prep.audio_row_positions)
            rows = rows.index_select(0, mine.to(rows.device))
        return rows, encoded

    def _vision_rows(
        self, prep: PreparedBatch, step: StepAgreement
    ) -> tuple[list[torch.Tensor], int]:
        """This rank's visual rows (scalable flow) or all of them (compat), main then deepstack.

        The tower runs on every rank even without images (EncoderDataParallel then encodes a dummy
        frame and keeps none of it), so every rank makes the same collectives and gradients, and
        FSDP's per-module collectives and the set of gradients match across DP ranks.
        """
        pixel_values = prep.pixel_values(self.adapter.vision_tower(self.model).dtype)
        row = self._row
        if self.vision == "replicate" and len(prep.grid_thw):
            rows = _as_rows(self.encode(pixel_values, prep.grid_thw, prep.kinds))
            encoded = row.vision_dp.units(prep.grid_thw, prep.kinds).num_units
            # The step's agreement right after the tower, as in the other modes (before their
            # rows' collective): a rank whose tower output or batch is wrong raises everywhere.
            need = int(prep.visual_mask.sum())
            wrong = (
                f"ContextParallelVLM: the vision tower returned {rows[0].shape[0]} rows, the "
                f"grids need {need}"
                if rows[0].shape[0] != need
                else None
            )
            agree("ContextParallelVLM vision", row.group, {}, error=wrong, step=step)
        else:
            route = {"plan": prep.plan, "row_positions": prep.row_positions}
            routed = self.vision in ("route", "split")
            out, encoded = row.vision_dp(
                pixel_values,
                prep.grid_thw,
                kinds=prep.kinds,
                local_pixels=prep.local_pixels,
                with_unit_count=True,
                step=step,
                **(route if routed else {}),
            )
            rows = _as_rows(out)
        if self.flow == "scalable" and self.vision not in ("route", "split"):
            mine = _local_row_order(prep, row.rank).to(rows[0].device)
            rows = [t.index_select(0, mine) for t in rows]
        return rows, encoded
