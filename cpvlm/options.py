"""CPOptions: the context-parallel options of every entry point, validated in one place.

``ContextParallelVLM`` (the library), ``cpvlm train`` (``ParallelConfig``) and ``cpvlm verify``
build one ``CPOptions`` and let it reject what cannot run, so the same invalid combination gets
the same message everywhere; its fields declare the options once, with their flags' help
(``cpvlm.config_cli``: ``ParallelConfig`` takes them with ``like``). Plain values, no torch: flags
are checked without loading it.

A message names the keyword and its flag (``vision='route' (--vision): ...``) and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Literal

from cpvlm.config_cli import arg
from cpvlm.constants import ATTN_IMPLS, FLOWS, LAYOUTS, VISION_MODES

CHOICES = {"attn": ATTN_IMPLS, "vision": VISION_MODES, "flow": FLOWS, "layout": LAYOUTS}
"""The options that take one of a few names, and their names."""

ALL_ROWS = ("allgather", "replicate")
"""The vision modes after which every rank holds every visual row (what ``flow="compat"`` needs);
"route" and "split" leave each rank only the rows of its own positions."""


def _flag(name: str) -> str:
    return "--cp" if name == "cp_size" else "--" + name.replace("_", "-")


def _fail(name: str, value: object, need: str, where: str = ""):
    where = f"{where}: " if where else ""
    raise ValueError(f"{where}{name}={value!r} ({_flag(name)}): {need}")


def check_choice(name: str, value: object, allowed: tuple[str, ...] | None = None) -> None:
    """``value`` is one of ``CHOICES[name]`` (and of ``allowed``, the names a command takes)."""
    if value not in CHOICES[name]:
        _fail(name, value, f"must be one of {', '.join(CHOICES[name])}")
    if allowed is not None and value not in allowed:
        _fail(name, value, f"not checked here; use {', '.join(allowed)}")


def _is_int(value: object, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


def check_ulysses_size(
    attn: str,
    ulysses_size: object,
    cp_size: int | None,
    *,
    attn_name: str = "attn",
    where: str = "",
) -> None:
    """``ulysses_size`` is None unless ``attn`` is "hybrid"; for "hybrid" an int >= 1 that divides
    ``cp_size`` (when known). ``attn_name``: what the caller calls the attention (``cp_attention``
    says ``impl``); ``where``: a prefix of the message (``cp_attention``)."""
    if attn != "hybrid":
        if ulysses_size is not None:
            _fail(
                "ulysses_size",
                ulysses_size,
                f"applies to {attn_name}='hybrid' only ({attn_name}={attn!r}); drop it or use "
                f"{attn_name}='hybrid'",
                where,
            )
        return
    if not _is_int(ulysses_size, 1) or (cp_size is not None and cp_size % ulysses_size):
        of = "the CP size" if cp_size is None else f"the CP size {cp_size}"
        divisors = "" if cp_size is None else f": one of {_divisors(cp_size)}"
        _fail(
            "ulysses_size",
            ulysses_size,
            f"{attn_name}='hybrid' splits the CP ranks into Ulysses groups of ulysses_size "
            f"consecutive ranks (a ring across them); pass a divisor of {of}{divisors}",
            where,
        )


def _divisors(n: int) -> list[int]:
    return [u for u in range(1, n + 1) if n % u == 0]


def checked(name: str, allowed: tuple[str, ...] | None = None, lists: bool = False):
    """An argparse ``type`` that gives a bad value the message ``CPOptions`` gives it (its
    check, called as the flag is read); ``allowed``: the names a command takes (default: all);
    ``lists``: a comma-separated list of them."""
    allowed = CHOICES[name] if allowed is None else allowed

    def parse(text: str):
        values = [v for v in text.split(",") if v] if lists else [text]
        if not values:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        for v in values:
            try:
                check_choice(name, v, allowed)
            except ValueError as err:
                raise argparse.ArgumentTypeError(str(err)) from None
        return values if lists else values[0]

    return parse


@dataclass(frozen=True)
class CPOptions:
    """How a VLM runs under context parallelism (the choices are in ``cpvlm.constants``).

    attn: the CP attention of the text model (``cpvlm.cp_attention``'s ``impl``).
    vision: how the CP ranks share the vision tower.
    flow: "scalable" (no full-length tensor on any rank) or "compat" (the full ``inputs_embeds``
        built, then sharded: needs every visual row on every rank, ``vision`` in ``ALL_ROWS``).
    layout: the ``ShardPlan`` layout of every batch, "head_tail" by default (as ``ShardPlan``'s).
        "balanced" places short packed documents whole on one rank: never worse by the layout's
        own measure (``cpvlm.distributed.layout``) and faster for ``cpvlm train``'s packed rows
        of short samples (docs/benchmarks.md), the same as head-tail for rows of one document;
        but the linear-attention layers (Qwen3.5's Gated DeltaNet) need every document split
        head-tail (``cpvlm.attention.linear.layout``), so only "head_tail" runs on every family.
    ulysses_size: ``attn="hybrid"`` only: ranks per Ulysses group, a divisor of the CP size.
    cp_size: the CP group size when known (the library: its group's; ``cpvlm train``: ``--cp``),
        checked against ``ulysses_size``; None: not known yet.
    """

    attn: Literal[ATTN_IMPLS] = arg(
        "ring",
        type=checked("attn"),
        help="CP attention of the text model (auto: chosen per batch by a cost model; hybrid: "
        "Ulysses groups of --ulysses-size ranks, a ring across them)",
    )
    vision: Literal[VISION_MODES] = arg(
        "route",
        type=checked("vision"),
        help="how the CP ranks share the vision tower: route (each image/frame encoded once, "
        "rows sent to their owners), allgather, split (large images sharded too), replicate",
    )
    flow: Literal[FLOWS] = arg(
        "scalable",
        type=checked("flow"),
        help="scalable: no rank builds full-length embeddings; compat: the full input embeddings "
        "built, then sharded (with --vision allgather or replicate)",
    )
    layout: Literal[LAYOUTS] = arg(
        "head_tail",
        type=checked("layout"),
        help="head_tail: every document in 2 x cp chunks; balanced: short packed documents "
        "whole on one rank, long ones head-tail (faster on packed short samples; not with "
        "linear-attention models such as Qwen3.5)",
    )
    ulysses_size: int | None = arg(
        None, help="--attn hybrid: ranks per Ulysses group, a divisor of --cp"
    )
    cp_size: int | None = arg(None, help="ranks of the CP group (--cp); None: not known yet")

    def __post_init__(self):
        if self.cp_size is not None and not _is_int(self.cp_size, 1):
            _fail("cp_size", self.cp_size, "must be an integer >= 1 (the ranks of the CP group)")
        for name in CHOICES:
            check_choice(name, getattr(self, name))
        check_ulysses_size(self.attn, self.ulysses_size, self.cp_size)
        if self.flow == "compat" and self.vision not in ALL_ROWS:
            _fail(
                "vision",
                self.vision,
                "flow='compat' builds the full input embeddings, which needs every visual row on "
                f"every rank; use vision={ALL_ROWS[0]!r} or {ALL_ROWS[1]!r} with it (--vision "
                f"{'|'.join(ALL_ROWS)}), or flow='scalable'",
            )

    def replace(self, **changes) -> CPOptions:
        """A copy with ``changes``, validated again."""
        return dataclasses.replace(self, **changes)

    @property
    def attention(self) -> AttentionOptions:
        """What ``cp_attention`` takes of these options (the text model's, and the split
        tower's)."""
        return AttentionOptions(self.attn, self.ulysses_size)


@dataclass(frozen=True)
class AttentionOptions:
    """The options of ``cp_attention`` besides its inputs: ``impl`` (``CPOptions.attn``) and,
    for "hybrid", ``ulysses_size``. Checked where they meet their group (``cp_attention``,
    ``EncoderDataParallel``), by the rules of ``CPOptions``."""

    impl: str = "ring"
    ulysses_size: int | None = None


DEFAULTS = CPOptions()
"""Every option's one default (the library's, ``cpvlm train``'s and ``cpvlm verify``'s)."""


def problem(**fields) -> str | None:
    """The message ``CPOptions(**fields)`` raises, or None when those options are valid."""
    try:
        CPOptions(**fields)
    except ValueError as err:
        return str(err)
    return None
