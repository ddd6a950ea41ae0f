"""The trainer's data: the source and processor named by the config, and the rank loader.

Per step (see ``cpvlm.data.loader``) every rank gets its DP replica's rows, the pixels of the
units its CP rank encodes only. Two things need all ranks before a row runs:

- bad samples found while planning are the same on every rank (the DP ranks of a CP slice split
  the planning and exchange what they found, on a gloo group of their own: ``dp_exchange``);
  rank 0 writes them to ``data_errors.jsonl``, and under ``--strict`` every rank stops at once
  with the same line;
- a unit that failed to decode is known only to the rank that decoded it. One small all-reduce
  per step tells every rank which rows of which replica failed; those rows are replaced by a row
  that trains nothing (``LocalRow.blank``) on all the replica's CP ranks, the failure is logged,
  or under ``--strict`` every rank raises the same one-line ``DataError``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from cpvlm.data import (
    DataError,
    ErrorLog,
    LoaderConfig,
    LocalRow,
    RankLoader,
    RowStream,
    TokenIds,
    open_source,
    parse_data_args,
    plan_tokenized,
)
from cpvlm.data.exchange import DPExchange
from cpvlm.data.prepared import PreparedSource
from cpvlm.data.sources import ObjectSource
from cpvlm.train.config import TrainConfig

PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_processor(model_name: str) -> bool:
    """Whether ``--model`` is a directory holding a tokenizer (and so, normally, a processor)."""
    path = Path(model_name)
    return path.is_dir() and any((path / f).is_file() for f in PROCESSOR_FILES)


def token_ids(model_config) -> TokenIds:
    """The data path's ids of ``model_config``, with its family's token-type rule (the adapter's:
    video frames may be image tokens inside video markers)."""
    from cpvlm.hf.data.processor import adapter_token_ids

    return adapter_token_ids(model_config)


def _tokenized_only(ids: TokenIds):
    def plan(record):
        if not isinstance(record.data, dict) or "input_ids" not in record.data:
            raise DataError(
                "bad_record",
                "a conversation needs the model's processor: pass --model DIR, a checkpoint "
                "directory with its tokenizer, chat template and image processor",
            )
        return plan_tokenized(record.data, ids, record.index, record.where)

    def decode(item, temporal):
        raise DataError("bad_record", "tokenized samples carry their pixels")

    return plan, decode


def build_source(config: TrainConfig, model_config):
    spec = config.data.source
    if spec == "synthetic":
        from cpvlm.train.synthetic import SyntheticVLMData

        return ObjectSource(SyntheticVLMData(model_config, seed=config.run.seed), "synthetic")
    return open_source(
        spec,
        data_args=parse_data_args(config.data.data_args),
        model_config=model_config,
        seed=config.run.seed,
    )


def build_encoder(config: TrainConfig, model_config, source=None):
    """``(plan, decode, temporal patch)``: the checkpoint's processor, or tokenized samples only;
    a prepared ``source`` (``cpvlm prepare``) plans from its columns, if its key is this run's."""
    if not has_processor(config.model.name):
        return (*_tokenized_only(token_ids(model_config)), 2)
    from cpvlm.hf.data.processor import ChatEncoder

    d = config.data
    encoder = ChatEncoder(
        config.model.name,
        model_config,
        train_on=d.train_on,
        min_pixels=d.min_pixels,
        max_pixels=d.max_pixels,
        video_min_pixels=d.video_min_pixels,
        video_max_pixels=d.video_max_pixels,
    )
    plan = encoder.plan
    if isinstance(source, PreparedSource):
        from cpvlm.hf.data.prepared_key import check_prepared

        check_prepared(source, encoder, model_config, d)
        plan = source.plan
    return plan, encoder.decode, encoder.temporal_patch


def dp_exchange(groups, dp: int, cp: int) -> DPExchange | None:
    """A gloo group over the DP ranks of this rank's (CP, TP) slice (collective: every rank
    builds every slice's group, in the same order)."""
    if dp == 1:
        return None
    ranks = groups.mesh.mesh.reshape(dp, -1)  # (cp, tp) coordinates, tp innermost
    slices = [dist.new_group(ranks[:, i].tolist(), backend="gloo") for i in range(ranks.shape[1])]
    return DPExchange(slices[groups.cp_rank * groups.sizes.tp + groups.tp_rank])


def dynamic_cp_tokens(config: TrainConfig) -> int | None:
    """``--dynamic-cp``'s per-rank token budget of a row (``--dynamic-cp-tokens``, by default
    what a full row leaves each rank under static CP: no rank holds more); None: static CP."""
    p = config.parallel
    if not p.dynamic_cp:
        return None
    return (
        p.dynamic_cp_tokens if p.dynamic_cp_tokens is not None else -(-config.data.seq_len // p.cp)
    )


def build_loader(
    config: TrainConfig, model_config, groups, *, assign, pieces=None, state=None
) -> RankLoader:
    from cpvlm.hf.data.row_cost import row_cost

    d = config.data
    source = build_source(config, model_config)
    plan, decode, temporal_patch = build_encoder(config, model_config, source)
    stream = RowStream(
        source,
        plan,
        seq_len=d.seq_len,
        window=d.pack_window,
        seed=config.run.seed,
        shuffle=d.shuffle,
    )
    loader = LoaderConfig(
        rows_per_step=d.batch_size * d.grad_accum,
        dp_rank=groups.dp_rank,
        dp_size=config.parallel.dp,
        cp_rank=groups.cp_rank,
        cp_size=config.parallel.cp,
        decode_mode=d.decode,
        num_workers=d.num_workers,
        prefetch=d.prefetch,
        temporal_patch=temporal_patch,
        balance=d.dp_balance,
        dynamic_cp_tokens=dynamic_cp_tokens(config),
    )
    return RankLoader(
        stream,
        decode,
        token_ids(model_config),
        loader,
        assign=assign,
        pieces=pieces,
        state=state,
        row_cost=row_cost(model_config)
        if d.dp_balance == "cost" or config.parallel.dynamic_cp
        else None,
        exchange=None
        if stream.has_meta
        else dp_exchange(groups, config.parallel.dp, config.parallel.cp),
    )


def report_planning_errors(rows: list[LocalRow], log: ErrorLog, step: int) -> int:
    """Log (rank 0) or raise (``--strict``, every rank) the bad samples planned with this step."""
    errors = [e for r in rows for e in r.errors]
    for err in errors:
        log.add(err, step)
    return len(errors)


def agree_on_decode_failures(
    rows: list[LocalRow], groups, dp: int, device, log: ErrorLog, step: int
) -> tuple[list[LocalRow], int]:
    """Replace the rows whose decoding failed on any CP rank of their replica (see above).

    Returns the rows and the number of rows of this replica replaced. One all-reduce over all
    ranks per step; the messages travel only when something failed.
    """
    flags = torch.zeros(dp, len(rows), dtype=torch.float64, device=device)
    flags[groups.dp_rank] = torch.tensor([r.error is not None for r in rows], dtype=torch.float64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if not bool(flags.any()):
        return rows, 0
    mine = [(groups.dp_rank, k, r.error.record()) for k, r in enumerate(rows) if r.error]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first = {}  # one error per failed row (a video split over ranks can fail on several)
    for d, k, e in sorted((d, k, tuple(e.items())) for per in everyone for d, k, e in per):
        first.setdefault((d, k), DataError(**dict(e)))
    errors = [(d, k, err) for (d, k), err in first.items()]
    if log.strict:
        d, k, err = errors[0]
        raise DataError(
            err.reason, f"{err.detail} (step {step}, DP replica {d}, row {k})", err.where
        )
    for _, _, err in errors:  # every rank counts them all; rank 0 writes them
        log.add(err, step)
    replaced = sorted({k for d, k, _ in errors if d == groups.dp_rank})
    for k in replaced:
        rows[k] = rows[k].blank()
    return rows, len(replaced)
