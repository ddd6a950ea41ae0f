"""Render docs/benchmarks.md's generated tables from benchmarks/results/*.json.

Each generated table sits between ``<!-- gen:NAME -->`` and ``<!-- /gen:NAME -->``; everything
else on the page is written by hand. Run ``python docs/gen_benchmarks.py`` after a benchmark
rewrites its JSON; ``--check`` exits 1 when the page differs from what the JSON gives
(tests/test_docs.py runs it), so a figure cannot drift from its measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
BLOCK = re.compile(r"(<!-- gen:(\w+) -->\n)(.*?)(<!-- /gen:\2 -->)", re.S)


def _load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _table(head: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    return "\n".join([line(head), "|" + "---|" * len(head)] + [line(row) for row in rows])


def _sci(x: float) -> str:
    """One significant digit, as the page writes errors: 3e-7."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def balance() -> str:
    rows = _load("balance")["rows"]
    mixes = list(dict.fromkeys(r["mix"] for r in rows))
    out = []
    for mix in mixes:
        rs = sorted((r for r in rows if r["mix"] == mix), key=lambda r: r["cp"])
        docs = rs[0]["docs"]
        label = {
            "many short documents": f"{docs} short documents",
            "skewed mix": f"skewed mix ({docs} documents)",
        }.get(mix, mix)

        def ratios(key, rs=rs):
            return " / ".join(f"{r[key]:.3f}" for r in rs)

        def pct(key, digits, rs=rs):
            if all(r[key] == 0 for r in rs):
                return "0"
            return " / ".join(f"{r[key]:.{digits}f}%" for r in rs)

        out.append(
            [
                label,
                ratios("head_tail_max_over_mean"),
                ratios("balanced_max_over_mean"),
                ratios("contiguous_max_over_mean"),
                pct("padding_pct", 1),
                pct("balanced_padding_pct", 2),
            ]
        )
    cps = " / ".join(str(r["cp"]) for r in rows if r["mix"] == mixes[0])
    head = ["document mix", f"head-tail, cp {cps}", f"balanced, cp {cps}", "contiguous split"]
    return _table(head + ["padding: head-tail", "padding: balanced"], out)


def attention() -> str:
    rows = []
    for r in _load("attention")["rows"]:
        err = max(float(r[k]) for k in ("err_b", "err_c", "err_d"))
        ratios = [f"{r['b/a']:.2f}", f"{r['c/a']:.2f}", f"{r['b/d']:.3f}", f"{r['c/d']:.3f}"]
        rows.append([str(r["S"]), *ratios, _sci(err)])
    return _table(["S", "b/a", "c/a", "b/d", "c/d", "max error of b, c, d vs a"], rows)


def linear_attention() -> str:
    def secs(x: float) -> str:
        return f"{x:.1f}" if x >= 10 else f"{x:.2f}"

    rows = []
    for r in _load("linear_attention")["rows"]:
        rows.append(
            [
                str(r["S"]),
                str(r["cp"]),
                secs(r["a_s"]),
                secs(r["rank_s"]),
                f"{r['slowest/a']:.2f}",
                f"{r['sum/a']:.2f}",
                f"{r['scan share']:.1%}",
                f"{r['map MiB']:.0f}",
                f"{r['halo KiB']:.0f}",
            ]
        )
    head = ["S", "cp", "(a) s", "slowest rank s", "x (a)", "all ranks x (a)", "scan share"]
    return _table(head + ["maps MiB", "halo KiB"], rows)


def memory_vocab() -> str:
    rows = []
    for r in _load("memory_vocab")["rows"]:
        ratio = f"{r['peak chunk/whole']:.2f}" if r["loss"] == "chunked" else ""
        rows.append(
            [str(r["cp"]), r["loss"], f"{r['saved_MiB']:.0f}", f"{r['peak_MiB']:.0f}", ratio]
        )
    return _table(["cp", "loss", "saved MiB", "peak MiB", "chunked / whole peak"], rows)


# The points of the host grid the page shows, (S, documents); host.json has all 16.
HOST_POINTS = [(32768, 1024), (131072, 1024), (524288, 1024), (2**20, 64), (2**20, 1024)]
HOST_POINTS += [(2**20, 4096)]
LENGTH_NAMES = {32768: "32k", 131072: "128k", 524288: "512k", 2**20: "1M"}


def host_schedule() -> str:
    """One middle rank's ring schedule, head-tail, causal / window 4096, CPU ms."""
    ms = {}
    for r in _load("host")["rows"]:
        if (r["part"], r.get("layout"), r.get("impl")) == ("schedule", "head_tail", "ring"):
            ms[r["S"], r["docs"], r["cp"], r["mask"]] = r["cpu_ms"]
    cps = sorted({cp for (_, _, cp, _) in ms})
    rows = []
    for s, docs in HOST_POINTS:
        cells = [
            f"{ms[s, docs, cp, 'causal']:.0f} / {ms[s, docs, cp, 'window 4096']:.0f}" for cp in cps
        ]
        rows.append([LENGTH_NAMES[s], str(docs), *cells])
    return _table(["S", "documents", *(f"cp {cp}" for cp in cps)], rows)


# The (mix, dp, R) points of the modelled DP deal the page shows; dp_balance.json has the grid.
DP_POINTS = [("long_tailed", 2, 4), ("long_tailed", 4, 4), ("long_tailed", 8, 2)]
DP_POINTS += [
    ("long_tailed", 8, 4),
    ("long_tailed", 8, 8),
    ("text_heavy", 8, 4),
    ("text_heavy", 8, 8),
]
MIX_NAMES = {"long_tailed": "long-tailed", "text_heavy": "text-heavy"}
MIX_FIRST = {"long_tailed": "long-tailed (a few long videos, many short image chats)"}


def dp_balance() -> str:
    by_point = {(r["mix"], r["dp"], r["R"]): r for r in _load("dp_balance")["modelled"]}
    rows, seen = [], set()
    for mix, dp, per_rank in DP_POINTS:
        r = by_point[mix, dp, per_rank]
        label = MIX_NAMES[mix] if mix in seen else MIX_FIRST.get(mix, MIX_NAMES[mix])
        seen.add(mix)
        rows.append(
            [
                label,
                str(dp),
                str(per_rank),
                f"{r['tokens_max_mean']:.3f}",
                f"{r['cost_max_mean']:.3f}",
                f"{r['bound']:.3f}",
                f"{r['tokens_time_lost']:.1%} / {r['cost_time_lost']:.1%}",
                f"{r['steps_bound_le_1.05']:.0%}",
                f"{r['cost_where_bound_allows']:.3f}",
            ]
        )
    head = ["mix", "dp", "R", "token deal", "cost deal", "bound", "waiting: tokens / cost"]
    return _table(head + ["steps with bound <= 1.05", "cost deal, worst of those"], rows)


def checkpoint() -> str:
    rows, ratio = [], {}
    for r in _load("checkpoint")["rows"]:
        keys = ("step_s", "save_s", "stall_s", "after_s", "cost_s")
        rows.append([r["mode"], *(f"{r[k]:.3f} s" for k in keys)])
        ratio = r if "stall async/sync" in r else ratio
    if ratio:
        stall, cost = ratio["stall async/sync"], ratio["cost async/sync"]
        rows.append(["async / sync", "", "", f"{stall:.3f}", "", f"{cost:.2f}"])
    head = ["mode", "median step", "the saving step", "stall (save step - median)"]
    head += ["extra time of the following steps", "cost per checkpoint"]
    return _table(head, rows)


def simulate_check_depth() -> str:
    rows = []
    for r in _load("simulate_check_depth")["rows"]:
        rows.append(
            [
                r["model"],
                r["seq"],
                str(r["cp"]),
                r["fit"],
                "yes" if r["saved_equal"] else "no",
                "yes" if r["weights_equal"] else "no",
                f"{r['peak_fwd_bwd/full']:.5f}",
                f"{r['steady_peak/full']:.5f}",
                str(round(r["cpu_s"])),
                str(round(r["load1"])),
            ]
        )
    head = ["model", "sequence", "cp", "depth", "saved equal", "params/grads/AdamW equal"]
    head += ["fwd+bwd peak / every layer's", "steady peak / every layer's", "CPU s", "load"]
    return _table(head, rows)


def _scale_tables() -> list[str]:
    """The two scale tables, as ``benchmarks/scale.py --markdown`` prints them."""
    spec = importlib.util.spec_from_file_location("_scale", ROOT / "benchmarks" / "scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.markdown(_load("scale")["rows"]).split("\n\n")


def scale_peak() -> str:
    return _scale_tables()[0]


def scale_longest() -> str:
    return _scale_tables()[1]


TABLES = {
    "balance": balance,
    "attention": attention,
    "linear_attention": linear_attention,
    "memory_vocab": memory_vocab,
    "host_schedule": host_schedule,
    "dp_balance": dp_balance,
    "checkpoint": checkpoint,
    "simulate_check_depth": simulate_check_depth,
    "scale_peak": scale_peak,
    "scale_longest": scale_longest,
}


def render(text: str) -> str:
    """``text`` with every generated block replaced by what the JSON gives now."""

    def fill(m: re.Match) -> str:
        return m.group(1) + TABLES[m.group(2)]() + "\n" + m.group(4)

    return BLOCK.sub(fill, text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the page is not up to date")
    args = p.parse_args()
    text = PAGE.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python docs/gen_benchmarks.py")
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
