"""`cpvlm verify`: check a model's CP loss and gradients against the one-process run.

Run it on your model config before a long job:

    cpvlm verify --model qwen3-vl-tiny --cp 2,4
    cpvlm verify --model /path/to/Qwen3-VL-checkpoint --cp 2 --dtype float64

For each CP size and (attn, vision, flow) combination it runs one synthetic batch (images of
several sizes, a video, a text-only row) and one packed row of documents through
``ContextParallelVLM`` on real gloo processes, sums the loss shares and gradients over the CP ranks,
and compares them with the unwrapped model's own forward and backward on one process. It prints
the largest relative gradient error of each module group and exits 1 if any error (or the loss
difference) exceeds the dtype's tolerance, naming the group.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpvlm.constants import ATTN_IMPLS, FLOWS, IGNORE_INDEX, VISION_MODES

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCES = {
    # Round-off only: the CP run sums the same terms in another order.
    "float64": 1e-10,
    "float32": 1e-5,
    # bf16 keeps 8 bits: a reordered sum can move a value by a few ulps (2**-8 = 4e-3 each).
    "bfloat16": 5e-2,
}
# Module groups, first match wins: (label, parameter-name prefixes).
GROUPS = (
    ("vision patch embed", ("model.visual.patch_embed", "model.visual.pos_embed")),
    ("vision blocks", ("model.visual.blocks",)),
    ("vision merger", ("model.visual.merger",)),
    ("deepstack mergers", ("model.visual.deepstack_merger_list",)),
    ("token embeddings", ("model.language_model.embed_tokens",)),
    ("decoder layers", ("model.language_model.layers", "model.language_model.norm")),
    ("lm head", ("lm_head",)),
)


def tolerance(dtype: str, vision: str, tol: float | None = None) -> float:
    """The check's tolerance: ``tol`` if given, else the dtype's.

    ``vision="replicate"`` in float64 gets 1e-6: every rank encodes every unit and back-propagates
    only its own rows, so the tower's gradient is a sum of cp partial gradients, and the models
    round each one to float32 where they upcast (vision rotary, RMSNorm); measured <= 1e-9.
    """
    if tol is not None:
        return tol
    if vision == "replicate" and dtype == "float64":
        return 1e-6
    return TOLERANCES[dtype]


def group_of(param_name: str) -> str:
    for label, prefixes in GROUPS:
        if param_name.startswith(prefixes):
            return label
    return "other"


@dataclass(frozen=True)
class Case:
    cp: int
    attn: str
    vision: str
    flow: str
    batch: str

    def __str__(self) -> str:
        return f"cp={self.cp} attn={self.attn} vision={self.vision} flow={self.flow} batch={self.batch}"


# ---- batches --------------------------------------------------------------------------------


def verify_batches(model, dtype: torch.dtype) -> dict[str, tuple[dict, list | None]]:
    """``{name: (batch, doc_lens)}``: a mixed padded batch and a packed row of documents."""
    from cpvlm.integrations.hf import SampleSpec, synthetic_batch

    m = model.config.vision_config.spatial_merge_size
    mixed = synthetic_batch(
        model.config,
        [
            SampleSpec(
                images=((2 * m, 2 * m), (4 * m, 2 * m)), videos=((2, 2 * m, 2 * m),), text_len=21
            ),
            SampleSpec(text_len=30),
        ],
        dtype=dtype,
        seed=1,
    )
    docs = [
        SampleSpec(images=((2 * m, 4 * m),), text_len=9),
        SampleSpec(text_len=3),
        SampleSpec(images=((2 * m, 2 * m),), videos=((2, 2 * m, 2 * m),), text_len=12),
    ]
    parts = [
        synthetic_batch(model.config, [d], dtype=dtype, seed=10 + i) for i, d in enumerate(docs)
    ]
    return {
        "mixed": (mixed, None),
        "packed": (pack_documents(parts), [p["input_ids"].shape[1] for p in parts]),
    }


def pack_documents(parts: Sequence[dict]) -> dict:
    """One packed row from single-row, unpadded batches (their documents, in order)."""
    packed = {}
    for key in ("input_ids", "labels", "mm_token_type_ids"):
        packed[key] = torch.cat([p[key] for p in parts], dim=1)
    for key in (
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "second_per_grid_ts",
    ):
        present = [p[key] for p in parts if key in p]
        if present:
            packed[key] = torch.cat(present)
    return packed


def reference(model, batch: dict, doc_lens: list | None) -> tuple[torch.Tensor, dict]:
    """The unwrapped model on one process: mean CE over valid labels, per document if packed."""
    model.zero_grad(set_to_none=True)
    bounds = [0]
    for n in doc_lens or [batch["input_ids"].shape[1]]:
        bounds.append(bounds[-1] + n)
    total, count = 0, 0
    videos_seen, images_seen = 0, 0
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        doc = _document(model, batch, a, b, images_seen, videos_seen) if doc_lens else batch
        images_seen += 0 if doc.get("image_grid_thw") is None else len(doc["image_grid_thw"])
        videos_seen += 0 if doc.get("video_grid_thw") is None else len(doc["video_grid_thw"])
        inputs = {k: v for k, v in doc.items() if k != "labels"}
        logits = model(**inputs, use_cache=False).logits
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        labels = doc["labels"][:, 1:].reshape(-1)
        total = total + F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            labels,
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        count += int((labels != IGNORE_INDEX).sum())
        model.model.rope_deltas = None
    loss = total / max(count, 1)
    loss.backward()
    grads = {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _document(model, batch, a, b, images_seen, videos_seen) -> dict:
    config = model.config
    m2 = config.vision_config.spatial_merge_size**2
    ids = batch["input_ids"][:, a:b]
    doc = {k: batch[k][:, a:b] for k in ("input_ids", "labels", "mm_token_type_ids") if k in batch}
    for kind, token, pix_key, grid_key in (
        ("image", config.image_token_id, "pixel_values", "image_grid_thw"),
        ("video", config.video_token_id, "pixel_values_videos", "video_grid_thw"),
    ):
        n_tokens = int((ids == token).sum())
        if not n_tokens:
            continue
        grids = batch[grid_key]
        first = images_seen if kind == "image" else videos_seen
        rows_before = int(grids[:first].prod(-1).sum())
        got, last = 0, first
        while got < n_tokens:
            got += int(grids[last].prod()) // m2
            last += 1
        doc[grid_key] = grids[first:last]
        doc[pix_key] = batch[pix_key][
            rows_before : rows_before + int(grids[first:last].prod(-1).sum())
        ]
        if kind == "video" and "second_per_grid_ts" in batch:
            doc["second_per_grid_ts"] = batch["second_per_grid_ts"][first:last]
    return doc


# ---- the CP side (runs on every rank) -------------------------------------------------------


def default_cp_model(model, group, attn: str, vision: str, flow: str):
    from cpvlm.integrations.hf import ContextParallelVLM

    return ContextParallelVLM(model, group, attn=attn, vision=vision, flow=flow)


def _cp_rank_main(rank, world_size, model_spec, dtype, cases, factory):
    from cpvlm.integrations.hf import build_model

    base = build_model(model_spec, dtype=dtype, seed=0)
    batches = verify_batches(base, dtype)
    results = []
    for case in cases:
        model = copy.deepcopy(base)
        cp_model = factory(model, dist.group.WORLD, case.attn, case.vision, case.flow)
        batch, doc_lens = batches[case.batch]
        out = cp_model(**batch, doc_lens=doc_lens)
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        grads = {}
        for n, p in model.named_parameters():
            if not p.requires_grad:
                continue
            g = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
            dist.all_reduce(g)
            grads[n] = g
        results.append((loss, grads) if rank == 0 else None)
    return results


# ---- comparison and report ------------------------------------------------------------------


def compare(loss, grads, ref_loss, ref_grads) -> dict[str, float]:
    from cpvlm.testing import rel_err

    errors = {"loss": rel_err(loss, ref_loss)}
    for name, ref in ref_grads.items():
        label = group_of(name)
        errors[label] = max(errors.get(label, 0.0), rel_err(grads[name], ref))
    return errors


def run_verify(
    model_spec: str,
    cps: Sequence[int],
    attns: Sequence[str] = ("ring",),
    visions: Sequence[str] = ("route",),
    flows: Sequence[str] = ("scalable",),
    dtype: str = "float64",
    tol: float | None = None,
    factory: Callable = default_cp_model,
    timeout: float = 600.0,
    out=sys.stdout,
) -> bool:
    """Run the checks and print the table; True when every error is within tolerance.

    ``factory(model, group, attn, vision, flow)`` builds the CP module on each rank; it must be
    importable (module level). Tests pass a deliberately broken one to prove the check can fail.
    """
    from cpvlm.integrations.hf import build_model
    from cpvlm.testing import run_distributed

    torch_dtype = DTYPES[dtype]
    model = build_model(model_spec, dtype=torch_dtype, seed=0)
    batches = verify_batches(model, torch_dtype)
    refs = {name: reference(model, b, d) for name, (b, d) in batches.items()}
    labels = ["loss"] + [g for g, _ in GROUPS if any(group_of(n) == g for n in refs["mixed"][1])]

    skipped = [
        f"flow={f} vision={v}" for f in flows for v in visions if f == "compat" and v == "route"
    ]
    if len(skipped) == len(flows) * len(visions):
        raise ValueError("run_verify: flow='compat' needs vision='allgather' or 'replicate'")
    for combination in skipped:
        print(
            f"skipped {combination}: the compat flow needs every visual row on every rank", file=out
        )
    rows, failures = [], []
    for cp in cps:
        cases = [
            Case(cp, a, v, f, b)
            for f in flows
            for v in visions
            if not (f == "compat" and v == "route")
            for a in attns
            for b in batches
        ]
        per_rank = run_distributed(
            _cp_rank_main, cp, model_spec, torch_dtype, cases, factory, timeout=timeout
        )
        for case, (loss, grads) in zip(cases, per_rank[0], strict=True):
            errors = compare(loss, grads, *refs[case.batch])
            case_tol = tolerance(dtype, case.vision, tol)
            rows.append((case, errors, case_tol))
            failures += [(case, g, e, case_tol) for g, e in errors.items() if not e <= case_tol]

    _print_table(rows, labels, dtype, model_spec, out)
    for case, group, err, case_tol in failures:
        print(f"FAIL {group}: relative error {err:.2e} > {case_tol:.0e} at {case}", file=out)
    if not failures:
        print(f"OK: the loss and every gradient are within tolerance ({dtype})", file=out)
    return not failures


def _print_table(rows, labels, dtype, model_spec, out) -> None:
    head = ["cp", "attn", "vision", "flow", "batch", "tol", *labels]
    table = [
        [str(c.cp), c.attn, c.vision, c.flow, c.batch, f"{t:.0e}"]
        + [f"{e.get(g, 0.0):.1e}" for g in labels]
        for c, e, t in rows
    ]
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(head)]
    print(f"cpvlm verify: {model_spec}, {dtype} (max relative error per module group)", file=out)
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)), file=out)
    for r, (_, errors, t) in zip(table, rows, strict=True):
        bad = any(not e <= t for e in errors.values())
        line = "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True))
        print(line + ("  <- FAIL" if bad else ""), file=out)


def _csv(kind, allowed=None):
    def parse(text: str):
        values = [kind(v) for v in text.split(",") if v]
        if not values:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        if allowed is not None:
            bad = [v for v in values if v not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"{bad} not in {list(allowed)}")
        return values

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="qwen3-vl-tiny",
        help="qwen3-vl-tiny, qwen2.5-vl-tiny or a local checkpoint directory",
    )
    parser.add_argument(
        "--cp", type=_csv(int), default="2,4", help="CP sizes to check, comma-separated"
    )
    parser.add_argument(
        "--attn",
        type=_csv(str, ATTN_IMPLS),
        default=",".join(ATTN_IMPLS),
        help=f"CP attentions to check, comma-separated ({', '.join(ATTN_IMPLS)})",
    )
    parser.add_argument(
        "--vision",
        type=_csv(str, VISION_MODES),
        default="route",
        help=f"vision modes to check, comma-separated ({', '.join(VISION_MODES)})",
    )
    parser.add_argument(
        "--flow",
        type=_csv(str, FLOWS),
        default="scalable",
        help="flows to check, comma-separated (scalable; compat: the full input embeddings built "
        "then sharded, with --vision allgather or replicate)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float64",
        help="model and compute dtype; tolerance float64 1e-10, float32 1e-5, bfloat16 5e-2",
    )
    parser.add_argument(
        "--tol",
        type=float,
        default=None,
        help="relative error allowed, a finite number > 0 (default: the dtype's)",
    )


def _check_args(args) -> str | None:
    """The first problem with the flags, or None."""
    if any(c < 1 for c in args.cp):
        return f"--cp sizes must be >= 1, got {args.cp}"
    if args.tol is not None and not (math.isfinite(args.tol) and args.tol > 0):
        return f"--tol must be a finite number > 0, got {args.tol}"
    if all(f == "compat" and v == "route" for f in args.flow for v in args.vision):
        return (
            "--flow compat builds the full input embeddings, which needs every visual row on "
            "every rank: check it with --vision allgather or --vision replicate"
        )
    try:
        from cpvlm.train.launcher import model_config

        model_config(args.model)
    except ValueError as err:
        return str(err)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    from cpvlm.cli import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="cpvlm verify",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    problem = _check_args(args)
    if problem is not None:
        parser.error(problem)
    torch.set_num_threads(1)
    ok = run_verify(args.model, args.cp, args.attn, args.vision, args.flow, args.dtype, args.tol)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
