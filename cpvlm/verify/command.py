"""`cpvlm verify`: check a model's CP loss and gradients against the one-process run.

Run it on your model config before a long job:

    cpvlm verify --cp 2,4
    cpvlm verify --model /path/to/checkpoint --cp 2 --dtype float64

For each CP size and (attn, vision, flow, layout) combination it runs one synthetic batch
(images of several sizes, a video, a text-only row) and one packed row of documents through
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
from typing import Literal

import torch
import torch.distributed as dist

from cpvlm import options
from cpvlm.config_cli import add_fields, arg, from_args, help_of, like
from cpvlm.constants import ATTN_IMPLS, DTYPES
from cpvlm.options import DEFAULTS, CPOptions
from cpvlm.parallelize.expert_parallel import check_experts, expert_modules
from cpvlm.train.config import ModelConfig, ParallelConfig
from cpvlm.verify.batches import verify_batches
from cpvlm.verify.compare import FLOAT32_IN_FLOAT64, compare, group_of, module_groups, tolerance
from cpvlm.verify.reference import reference
from cpvlm.verify.runner import run_distributed
from cpvlm.verify.step import cp_loss_and_grads

CHECKED_IMPLS = tuple(a for a in ATTN_IMPLS if a != "auto")  # auto picks one of these


@dataclass(frozen=True)
class Case:
    cp: int
    attn: str
    vision: str
    flow: str
    batch: str
    ulysses_size: int | None = None
    layout: str = DEFAULTS.layout

    @property
    def attn_label(self) -> str:
        u = self.ulysses_size
        return self.attn if u is None else f"{self.attn} {u}x{self.cp // u}"

    def __str__(self) -> str:
        return (
            f"cp={self.cp} attn={self.attn_label} vision={self.vision} flow={self.flow} "
            f"layout={self.layout} batch={self.batch}"
        )


def hybrid_size(cp: int, ulysses_size: int | None) -> int:
    """The Ulysses size of a hybrid check at ``cp``: the one given, else cp's smallest divisor
    above 1 (2 for even cp)."""
    if ulysses_size is not None:
        return ulysses_size
    return next(u for u in range(2, cp + 1) if cp % u == 0) if cp > 1 else 1


# ---- the CP side (runs on every rank) -------------------------------------------------------


def default_cp_model(model, group, attn: str, vision: str, flow: str, **kwargs):
    from cpvlm.hf import ContextParallelVLM

    options = CPOptions(attn=attn, vision=vision, flow=flow, **kwargs)
    return ContextParallelVLM(model, group, options=options)


def _cp_rank_main(rank, world_size, model_spec, dtype, cases, factory, ep=1, tp=1):
    from cpvlm.hf import build_model, kit_for
    from cpvlm.hf.tensor_plan import apply_tensor_parallel
    from cpvlm.parallelize import build_mesh, mesh_groups, parallelize_experts

    base = build_model(model_spec, dtype=dtype, seed=0)
    if dtype == torch.float64:
        kit_for(base).float64_islands(base)
    batches = verify_batches(base, dtype)
    groups = None
    if ep > 1 or tp > 1:  # EP: ep consecutive ranks of the CP group; TP: tp ranks per CP rank
        groups = mesh_groups(build_mesh(dp_shard=1, cp=world_size // tp, ep=ep, tp=tp), ep=ep)
    results = []
    for case in cases:
        model = copy.deepcopy(base)
        summed = []
        if ep > 1:
            parallelize_experts(model, groups.ep_mesh["ep"])
        if tp > 1:
            summed = apply_tensor_parallel(model, groups.tp_mesh)
        extra = {"layout": case.layout}
        if case.ulysses_size is not None:
            extra["ulysses_size"] = case.ulysses_size
        cp_group = dist.group.WORLD if groups is None else groups.cp_group
        cp_model = factory(model, cp_group, case.attn, case.vision, case.flow, **extra)
        batch, doc_lens = batches[case.batch]
        tp_group = None if tp == 1 else groups.tp_mesh.get_group()
        _, loss, grads = cp_loss_and_grads(
            cp_model, batch, doc_lens, tp_summed=summed, tp_group=tp_group
        )
        results.append((loss, grads) if rank == 0 else None)
    return results


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
    out=None,
    ulysses_size: int | None = None,
    layouts: Sequence[str] = (DEFAULTS.layout,),
    ep: int = 1,
    tp: int = 1,
) -> bool:
    """Run the checks and print the table; True when every error is within tolerance.

    ``ep > 1``: the MoE experts are sharded over EP groups of ``ep`` ranks of each CP group
    (``cpvlm.parallelize.expert_parallel``; ``ep`` must divide every CP size and the experts).
    ``tp > 1``: each CP rank is ``tp`` ranks that split the decoder layers by the model's TP plan
    (``cpvlm.hf.tensor_plan``); a CP size of ``cp`` runs on ``cp * tp`` processes.

    ``factory(model, group, attn, vision, flow, layout=...)`` builds the CP module on each rank
    (with ``ulysses_size=`` too for "hybrid", see ``hybrid_size``); it must be importable (module
    level). Tests pass a deliberately broken one to prove the check can fail. A (vision, flow)
    pair that ``CPOptions`` rejects is skipped (all of them: ValueError).
    """
    from cpvlm.hf import build_model, kit_for

    out = sys.stdout if out is None else out  # the stdout of the call, not of the import
    torch_dtype = getattr(torch, dtype)
    model = build_model(model_spec, dtype=torch_dtype, seed=0)
    check_experts(ep, next((m.num_experts for m in expert_modules(model)), None), "ep", "--ep")
    from cpvlm.hf.tensor_plan import check_tp

    check_tp(tp, model, "tp (--tp)")
    kit = kit_for(model)
    if torch_dtype == torch.float64:
        kit.float64_islands(model)  # on the CP ranks' models too
    groups = module_groups(model)
    float32_groups = kit.float32_groups
    zero = kit.zero_gradients
    batches = verify_batches(model, torch_dtype)
    refs = {name: reference(model, b, d) for name, (b, d) in batches.items()}
    present = {group_of(n, groups) for n in refs["mixed"][1]}
    labels = ["loss"] + [g for g, _ in groups if g in present]

    skipped = {(v, f): options.problem(vision=v, flow=f) for f in flows for v in visions}
    skipped = {pair: why for pair, why in skipped.items() if why is not None}
    if len(skipped) == len(flows) * len(visions):
        raise ValueError(f"run_verify: {next(iter(skipped.values()))}")
    for (v, f), why in skipped.items():
        print(f"skipped flow={f} vision={v}: {why}", file=out)
    rows, failures = [], []
    for cp in cps:
        cases = [
            Case(cp, a, v, f, b, hybrid_size(cp, ulysses_size) if a == "hybrid" else None, lay)
            for f in flows
            for v in visions
            if (v, f) not in skipped
            for a in attns
            for lay in layouts
            for b in batches
        ]
        per_rank = run_distributed(
            _cp_rank_main, cp * tp, model_spec, torch_dtype, cases, factory, ep, tp, timeout=timeout
        )
        for case, (loss, grads) in zip(cases, per_rank[0], strict=True):
            errors = compare(loss, grads, *refs[case.batch], groups, zero)
            tols = {g: tolerance(dtype, case.vision, tol, g, float32_groups) for g in errors}
            rows.append((case, errors, tols))
            failures += [(case, g, e, tols[g]) for g, e in errors.items() if not e <= tols[g]]

    where = model_spec if tp == 1 else f"{model_spec} at tp {tp} (cp x tp processes per CP size)"
    _print_table(rows, labels, dtype, where, out)
    for case, group, err, case_tol in failures:
        print(f"FAIL {group}: relative error {err:.2e} > {case_tol:.0e} at {case}", file=out)
    if not failures:
        print(f"OK: the loss and every gradient are within tolerance ({dtype})", file=out)
    return not failures


def _print_table(rows, labels, dtype, model_spec, out) -> None:
    head = ["cp", "attn", "vision", "flow", "layout", "batch", "tol", *labels]
    table = [
        [str(c.cp), c.attn_label, c.vision, c.flow, c.layout, c.batch, f"{t['loss']:.0e}"]
        + [
            f"{e.get(g, 0.0):.1e}" + ("*" if t.get(g, t["loss"]) != t["loss"] else "")
            for g in labels
        ]
        for c, e, t in rows
    ]
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(head)]
    print(f"cpvlm verify: {model_spec}, {dtype} (max relative error per module group)", file=out)
    if any(t.get(g) != t["loss"] for _, _, t in rows for g in t):
        print(
            f"  * checked at {FLOAT32_IN_FLOAT64:.0e}: the model computes it in float32", file=out
        )
    elif dtype == "float64" and any(t["loss"] == FLOAT32_IN_FLOAT64 for _, _, t in rows):
        print(
            f"  tol {FLOAT32_IN_FLOAT64:.0e}: the model computes a part in float32 (replicate "
            "mode, or a float32 router whose backward reaches every gradient)",
            file=out,
        )
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)), file=out)
    for r, (_, errors, t) in zip(table, rows, strict=True):
        bad = any(not e <= t[g] for g, e in errors.items())
        line = "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True))
        print(line + ("  <- FAIL" if bad else ""), file=out)


VERIFY_DTYPES = tuple(sorted(DTYPES))


def _each_checked(name: str, allowed=None):
    """The help of a list of ``CPOptions`` field ``name``, and its comma-separated type."""
    allowed = options.CHOICES[name] if allowed is None else allowed
    return dict(
        sep=",",
        type=options.checked(name, allowed, lists=True),
        metavar="{" + ",".join(allowed) + "}[,...]",
        help=lambda: "comma-separated, each checked: " + help_of(CPOptions, name),
    )


@dataclass(frozen=True)
class VerifyConfig:
    """The flags of ``cpvlm verify`` (``cpvlm.config_cli``): the model, the dtype, and lists of
    CP options, every combination of which is checked. Validated when built: every --cp size,
    --ulysses-size at each (with hybrid), and at least one (vision, flow) pair ``CPOptions``
    accepts (``run_verify`` skips the others); the tolerance; the model."""

    model: str = like(ModelConfig, "name")
    cp: tuple[int, ...] = arg((2, 4), sep=",", help="CP sizes to check, comma-separated")
    attn: tuple[str, ...] = arg(CHECKED_IMPLS, **_each_checked("attn", CHECKED_IMPLS))
    vision: tuple[str, ...] = arg((DEFAULTS.vision,), **_each_checked("vision"))
    flow: tuple[str, ...] = arg((DEFAULTS.flow,), **_each_checked("flow"))
    layout: tuple[str, ...] = arg((DEFAULTS.layout,), **_each_checked("layout"))
    ulysses_size: int | None = arg(
        None,
        help="--attn hybrid: ranks per Ulysses group, a divisor of every --cp (default: the "
        "smallest divisor above 1 of each)",
    )
    dtype: Literal[VERIFY_DTYPES] = arg(
        "float64",
        help="model and compute dtype; tolerance float64 1e-10, float32 1e-5, bfloat16 5e-2",
    )
    tol: float | None = arg(
        None, help="relative error allowed, a finite number > 0 (default: the dtype's)"
    )
    ep: int = like(
        ParallelConfig,
        "ep",
        help="expert parallelism (MoE models): the experts sharded over EP groups of N ranks of "
        "each CP group; N divides every --cp and the number of experts",
    )
    tp: int = like(
        ParallelConfig,
        "tp",
        help="tensor parallelism: each CP rank is N processes that split the decoder layers "
        "(heads, MLP columns); N divides the heads, key-value heads and MLP width",
    )

    def __post_init__(self):
        for name in ("cp", "attn", "vision", "flow", "layout"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name, allowed in (("attn", CHECKED_IMPLS), ("vision", None), ("flow", None)):
            for value in getattr(self, name):
                options.check_choice(name, value, allowed)
        for value in self.layout:
            options.check_choice("layout", value)
        problem = _problem(self)
        if problem is not None:
            raise ValueError(problem)


def _problem(c: VerifyConfig) -> str | None:
    """The first problem with the flags, or None. The CP options are ``CPOptions``' to judge."""
    u = c.ulysses_size
    if "hybrid" in c.attn:
        checks = [dict(cp_size=n, attn="hybrid", ulysses_size=hybrid_size(n, u)) for n in c.cp]
    else:
        checks = [dict(cp_size=n, attn=c.attn[0], ulysses_size=u) for n in c.cp]
    for why in (options.problem(**fields) for fields in checks):
        if why is not None:
            return why
    pairs = [options.problem(vision=v, flow=f) for f in c.flow for v in c.vision]
    if all(pairs):
        return pairs[0]
    if isinstance(c.ep, bool) or not isinstance(c.ep, int) or c.ep < 1:
        return f"--ep must be an integer >= 1, got {c.ep!r}"
    bad = [n for n in c.cp if n % c.ep]
    if bad:
        return (
            f"--ep {c.ep} must divide every --cp size (the EP groups are ep ranks of a CP group); "
            f"{bad[0]} is not a multiple of {c.ep}: use --ep 1 or CP sizes it divides"
        )
    if isinstance(c.tp, bool) or not isinstance(c.tp, int) or c.tp < 1:
        return f"--tp must be an integer >= 1, got {c.tp!r}"
    if c.tp > 1 and c.ep > 1:
        return f"--tp {c.tp} with --ep {c.ep}: tensor and expert parallelism do not combine yet"
    if c.tol is not None and not (math.isfinite(c.tol) and c.tol > 0):
        return f"--tol must be a finite number > 0, got {c.tol}"
    if c.dtype not in VERIFY_DTYPES:
        return f"--dtype must be one of {', '.join(VERIFY_DTYPES)}, got {c.dtype!r}"
    try:
        from cpvlm.hf.experts import num_experts
        from cpvlm.hf.tensor_plan import check_tp
        from cpvlm.train.launcher import model_config

        mc = model_config(c.model)
        check_experts(c.ep, num_experts(mc), "ep", "--ep")
        check_tp(c.tp, mc, "tp (--tp)")
    except ValueError as err:
        return str(err)
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``cpvlm verify``: one per ``VerifyConfig`` field."""
    add_fields(parser, VerifyConfig)


def build_parser() -> argparse.ArgumentParser:
    from cpvlm.cli import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="cpvlm verify",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        config = from_args(VerifyConfig, parser.parse_args(argv))
    except ValueError as err:
        parser.error(str(err))
    torch.set_num_threads(1)
    ok = run_verify(
        config.model,
        config.cp,
        config.attn,
        config.vision,
        config.flow,
        config.dtype,
        config.tol,
        ulysses_size=config.ulysses_size,
        layouts=config.layout,
        ep=config.ep,
        tp=config.tp,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
