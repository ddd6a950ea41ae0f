"""Render the docs' generated tables from benchmarks/results/*.json.

Each generated table sits between ``<!-- gen:NAME -->`` and ``<!-- /gen:NAME -->`` on one of
``PAGES``; everything else on a page is written by hand. Run ``python docs/gen_benchmarks.py``
after a benchmark rewrites its JSON; ``--check`` exits 1 when a page differs from what the JSON
gives (tests/test_docs.py runs it), so a figure cannot drift from its measurement.
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
# Every page with generated blocks; tests/test_docs.py checks that no other page has one.
PAGES = [ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "plan.md", ROOT / "docs" / "testing.md"]
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


def _load_range(loads) -> str:
    """``a to b`` (one decimal) over the 1-minute load averages ``loads``, or ``a``."""
    values = [float(x) for x in loads]
    lo, hi = min(values), max(values)
    return f"{lo:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f} to {hi:.1f}"


def _sig(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits, without an exponent: 0.0003, 3.37, 72.1, 3382."""
    if x == 0:
        return "0"
    text = f"{x:.{digits}g}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        if int(exponent) < 0:
            return f"{x:.{digits - 1 - int(exponent)}f}".rstrip("0").rstrip(".")
        return f"{x:.0f}"
    return text


# The rows of attention_impls.json the page shows, at S = 16384: (heads, docs, cp, layout).
IMPL_POINTS = [("8/2", "one sequence", 2, None), ("8/2", "one sequence", 4, None)]
IMPL_POINTS += [("8/2", "64 documents", 4, "head_tail"), ("8/2", "64 documents", 4, "balanced")]
IMPL_POINTS += [("8/8", "one sequence", 4, None), ("8/8", "64 documents", 4, "head_tail")]
IMPL_POINTS += [("8/8", "64 documents", 4, "balanced")]
IMPLS = ["ring", "allgather", "ulysses", "hybrid 2x2"]
LAYOUT_NAMES = {"head_tail": "head-tail", "balanced": "balanced"}


def attention_impls() -> str:
    rows, loads = [], []
    data = [r for r in _load("attention_impls")["rows"] if r["S"] == 16384]
    for heads, docs, cp, layout in IMPL_POINTS:
        got = {
            r["impl"]: r
            for r in data
            if (r["heads"], r["docs"], r["cp"]) == (heads, docs, cp)
            and (layout is None or r["layout"] == layout)
        }
        label = ", ".join([heads, docs, str(cp)] + ([LAYOUT_NAMES[layout]] if layout else []))
        cells = [f"{got[i]['cpu/a']:.2f}" if i in got else "" for i in IMPLS]
        mib = " / ".join(f"{got[i]['MiB/rank']:.0f}" for i in IMPLS if i in got)
        rows.append([label, *cells, mib, next(iter(got.values()))["auto"]])
        loads += [r["load"] for r in got.values()]
    head = ["heads, docs, cp, layout", "ring", "all-gather", "Ulysses", "hybrid 2x2"]
    table = _table(head + ["MiB/rank (same order)", "auto picks"], rows)
    return table + f"\n\nLoad average (1 minute) while these rows ran: {_load_range(loads)}."


def attention_window() -> str:
    data = _load("attention_window")["rows"]
    points = list(dict.fromkeys((r["cp"], r["w"]) for r in data))
    rows = []
    for cp, w in points:
        got = {r["impl"]: r for r in data if (r["cp"], r["w"]) == (cp, w)}
        cells = [f"{got[i]['wall/sdpa']:.2f} / {got[i]['cpu/sdpa']:.2f}" for i in IMPLS[:3]]
        work = f"{got['ring']['work/causal']:.3f}, {got['ulysses']['work/causal']:.3f}"
        rows.append([str(w), str(cp), *cells, work, f"{got['ring']['balance']:.2f}"])
    head = ["w", "cp", "ring wall / cpu", "all-gather wall / cpu", "Ulysses wall / cpu"]
    table = _table(head + ["work (ring, Ulysses)", "balance (ring)"], rows)
    errs = [float(r["err"]) for r in data]
    loads = _load_range(r["load"] for r in data)
    return (
        table
        + f"\n\nErrors against SDPA {_sci(min(errs))} to {_sci(max(errs))} (float32); load"
        + f" average (1 minute) while the rows ran: {loads}."
    )


MIX_LABELS = {"current": "current", "automodel": "Automodel", "long video": "long video"}


def vision_modelled() -> str:
    data = _load("vision_dp")["balance"]
    rows = []
    for mix in dict.fromkeys(r["mix"] for r in data):
        rs = sorted((r for r in data if r["mix"] == mix), key=lambda r: r["cp"])
        cells = [" / ".join(f"{r[k]:.3f}" for r in rs) for k in ("count", "patch", "cost", "bound")]
        rows.append([MIX_LABELS[mix], " / ".join(str(r["cp"]) for r in rs), *cells])
    head = ["mix", "cp", "by count (contiguous, public frameworks)", "by patches", "by cost"]
    return _table(head + ["bound"], rows)


def audio_balance() -> str:
    data = sorted(_load("audio_dp")["balance"], key=lambda r: r["cp"])
    keys = ("count", "size", "cost_per_encoder", "cost_around_vision", "cost_joint")
    rows = [[str(r["cp"]), *(f"{r[k]:.3f}" for k in keys)] for r in data]
    head = [
        "cp",
        "by count (contiguous)",
        "by size (patches, frames)",
        "by cost, each encoder alone",
        "by cost, clips around vision (cpvlm)",
        "by cost, jointly",
    ]
    return _table(head, rows)


def vision_measured() -> str:
    d = _load("vision_dp")
    data = d["encoder_time"]
    rows = []
    for mix in dict.fromkeys(r["mix"] for r in data):
        rs = sorted((r for r in data if r["mix"] == mix), key=lambda r: r["cp"])
        cells = [f"{r['measured_patch']:.3f} / {r['measured_cost']:.3f}" for r in rs]
        rows.append([MIX_LABELS[mix], *cells, " / ".join(f"{r['measured_same']:.3f}" for r in rs)])
    cps = sorted({r["cp"] for r in data})
    head = ["mix", *(f"cp {cp}" for cp in cps), f"noise floor cp {' / '.join(map(str, cps))}"]
    loads = " / ".join(f"{x:.1f}" for x in d["load_average"])
    return _table(head, rows) + f"\n\nLoad average (1 / 5 / 15 minutes) at the end: {loads}."


def vision_bytes() -> str:
    rows = []
    for r in _load("vision_dp")["comm"]:

        def mib(x: float) -> str:
            return f"{x:g}"

        rows.append(
            [
                str(r["cp"]),
                f"{mib(r['route_fwd_send_MiB'])} / {mib(r['route_fwd_recv_MiB'])}",
                mib(r["allgather_fwd_MiB"]),
                mib(r["allgather_bwd_allreduce_MiB"]),
            ]
        )
    head = ["cp", "MiB per rank: route (send / receive)", "all-gather (= reduce-scatter backward)"]
    return _table(head + ["all-reduce backward"], rows)


def memory() -> str:
    d = _load("memory")
    by = {(r["cp"], r["flow"]): r for r in d["rows"]}
    rows = []
    for cp in sorted({cp for cp, _ in by}):
        s, c = by[cp, "scalable"], by[cp, "compat"]
        full = []
        for flow in ("scalable", "compat"):
            n = max(len(r["full_len_floats"]) for r in d["ranks"][f"cp{cp}_{flow}"])
            full.append(f"{flow}: {n or 'none'}")
        rows.append(
            [
                str(cp),
                f"{s['saved_MiB']:.0f}",
                f"{s['saved x cp']:.2f}",
                f"{s['peak_MiB']:.0f}",
                f"{s['peak x cp']:.2f}",
                f"{c['peak_MiB']:.0f}",
                "-" if cp == 1 else "; ".join(full),
            ]
        )
    head = ["cp", "scalable: saved MiB", "x cp", "peak MiB", "x cp", "compat: peak MiB"]
    return _table(head + ["full-length float tensors on a rank"], rows)


TRAIN_NAMES = {
    ("route", "ring"): "route, ring",
    ("allgather", "ring"): "vision all-gather",
    ("replicate", "ring"): "vision replicate",
    ("route", "allgather"): "all-gather attention",
}


def train() -> str:
    d = _load("train")
    runs = d["sweep"] + [r for r in d["modes"] if (r["vision"], r["attn"]) != ("route", "ring")]
    base = d["sweep"][0]
    rows = []
    for r in runs:
        grows = "seq_MiB" in r
        rows.append(
            [
                f"CP {r['cp']}, {TRAIN_NAMES[r['vision'], r['attn']]}",
                f"{r['tok/s']:.0f}",
                f"{r['tok/s'] / base['tok/s']:.2f}",
                f"{r['seq_MiB']:.1f} MiB" if grows else "",
                f"{r['seq_MiB'] / base['seq_MiB']:.2f}" if grows else "",
            ]
        )
    head = ["run", "tokens/s", "x CP=1", "per-rank memory that grows with the sequence", "x CP=1"]
    before = d["config"]["load_average_before"][0]
    after = d["config"]["load_average_after"][0]
    return (
        _table(head, rows) + f"\n\nLoad average (1 minute): {before:.1f} before, {after:.1f} after."
    )


# The buckets of train_profile.json the page shows, with what each holds.
PROFILE_BUCKETS = [
    ("data", "data (planning rows in the main process; waiting for the loader)"),
    ("prepare", "prepare (positions, labels, plan; replicated)"),
    ("vision", "vision"),
    ("attention compute", "attention compute"),
    ("attention comm", "attention comm (exposed)"),
    ("decoder", "decoder (embeddings, layers, lm head)"),
    ("loss", "loss"),
    ("fsdp", "fsdp (all-gathers, reduce-scatters, copies, waiting for the other rank)"),
    ("optimizer", "optimizer (norm, clip, AdamW on DTensors)"),
    ("python", "python (between ops)"),
]


def train_profile() -> str:
    d = _load("train_profile")
    one, two = (next(r["ms"] for r in d["runs"] if r["cp"] == cp) for cp in (1, 2))

    def ms(x: float) -> str:
        return f"{x:.1f}" if x < 1 else f"{x:.0f}"

    rows = []
    for key, label in PROFILE_BUCKETS:
        rows.append([label, ms(one[key]), ms(two[key]), f"{two[key] - one[key]:+.0f}"])
    rows.append(["step wall (max over ranks)", ms(one["wall"]), ms(two["wall"]), ""])
    c = d["config"]
    before, after = c["load_average_before"][0], c["load_average_after"][0]
    tok = {r["cp"]: r["tok/s"] for r in d["runs"]}
    return (
        _table(["bucket", "CP=1", "CP=2", "CP=2 - CP=1"], rows)
        + f"\n\ntokens/s: {tok[1]:.0f} at CP=1, {tok[2]:.0f} at CP=2 ({tok[2] / tok[1]:.2f}x);"
        + f" load average (1 minute) {before:.1f} before, {after:.1f} after."
    )


def data_loading() -> str:
    d = _load("data")
    by = {(r["cp"], r["decode"]): r for r in d["loader"]}
    rows = []
    for cp in sorted({cp for cp, _ in by}):
        s, a = by[cp, "split"], by[cp, "all"]
        rows.append(
            [
                str(cp),
                f"{s['samples_per_s']:.2f}",
                f"{a['samples_per_s']:.2f}",
                f"{s['samples_per_s'] / a['samples_per_s']:.2f}",
                f"{s['decoded_per_rank_max']} / {a['decoded_per_rank_max']}",
            ]
        )
    head = ["cp", "samples/s, each rank decodes its own units", "decoding everything on every rank"]
    head += ["ratio", "images and frames decoded per rank (max)"]
    wait = ", ".join(
        f"{r['data_share']:.1%} of the step with {r['workers']} workers" for r in d["train"]
    )
    before, after = d["load_avg_before"][0], d["load_avg_after"][0]
    return (
        _table(head, rows)
        + f"\n\nPlanning every sample, on every rank: {by[1, 'split']['plan_s']:.2f} s. In `cpvlm"
        + f" train` (CP 2) a rank waits for its rows {wait}. Load average (1 minute):"
        + f" {before:.1f} before, {after:.1f} after."
    )


def _host_quick() -> dict:
    return {
        (r["part"], r.get("layout"), r.get("mask"), r.get("impl")): r
        for r in _load("host_quick")["rows"]
    }


def host_headline() -> str:
    got = _host_quick()
    cols = [(lay, mask) for lay in ("head_tail", "balanced") for mask in ("causal", "window 4096")]

    def ring(lay, mask):
        return got["schedule", lay, mask, "ring"]

    rows = [
        ["ring schedule, before (reference loops)"]
        + [f"{ring(*c)['reference_cpu_ms']:.0f}" for c in cols],
        ["ring schedule, now"] + [f"{ring(*c)['cpu_ms']:.1f}" for c in cols],
        ["ratio"] + [f"{ring(*c)['ratio']:.0f}x" for c in cols],
        ["hybrid (Ulysses 4 x ring 4) / Ulysses schedule"]
        + [
            f"{got[('schedule', *c, 'hybrid u=4')]['cpu_ms']:.1f}"
            f" / {got[('schedule', *c, 'ulysses')]['cpu_ms']:.1f}"
            for c in cols
        ],
        ['`impl="auto"`\'s choice (cost model over every candidate, pruned; chosen once per plan)']
        + [
            f"{next(r for k, r in got.items() if k[:3] == ('auto', *c))['cpu_ms']:.0f}"
            for c in cols
        ],
    ]
    head = ["part"] + [f"{LAYOUT_NAMES[lay]} {mask}" for lay, mask in cols]
    return _table(head, rows)


def host_parts() -> str:
    got = _host_quick()

    def ms(part, layout=None, mask=None, impl=None):
        return got[part, layout, mask, impl]["cpu_ms"]

    rows = [
        [
            "`ShardPlan`, head-tail / balanced",
            f"{ms('plan', 'head_tail'):.1f} / {ms('plan', 'balanced'):.1f}",
        ],
        [
            "position ids per document, 1D / M-RoPE",
            f"{ms('positions', impl='1d'):.1f} / {ms('positions', impl='mrope'):.1f}",
        ],
        ["vision unit assignment (1024 units)", f"{ms('vision'):.1f}"],
        ["one rank's route plan", f"{ms('route'):.1f}"],
    ]
    loads = _load_range(r["load"] for r in _load("host_quick")["rows"])
    return _table(["part", "ms"], rows) + f"\n\nLoad average (1 minute) during the run: {loads}."


def dp_measured() -> str:
    rows = []
    for r in _load("dp_balance")["measured"]["results"]:
        rows.append(
            [
                MIX_NAMES[r["mix"]],
                str(r["dp"]),
                f"{r['tokens_modelled']:.3f} / {r['tokens_measured']:.3f}",
                f"{r['cost_modelled']:.3f} / {r['cost_measured']:.3f}",
                f"{r['fitted_measured']:.3f}",
                f"{r['oracle_measured']:.3f}",
                f"{r['rank_corr_cost']:.2f}",
            ]
        )
    head = ["mix", "dp", "tokens: modelled / measured", "cost: modelled / measured"]
    head += [
        "fitted, measured",
        "oracle, measured",
        "rank-time correlation, cost model vs measured",
    ]
    shares = _load("dp_balance")["measured"]["shares"]
    loads = ", ".join(f"{MIX_NAMES[s['mix']]} {s['load']:.1f}" for s in shares)
    spread = ", ".join(f"{MIX_NAMES[s['mix']]} {s['repeat_spread']:.0%}" for s in shares)
    return (
        _table(head, rows)
        + f"\n\nLoad average (1 minute) while each mix was timed: {loads}; repeat spread: {spread}."
    )


def split_decode() -> str:
    rows = []
    for r in _load("split_decode")["results"]:
        rows.append(
            [
                str(r["cp"]),
                f"{r['rows_before_max']} -> {r['rows_after_max']}",
                f"{r['large_image_s_before']:.2f} -> {r['large_image_s_after']:.2f}"
                f" ({r['s_after/before']:.2f}x)",
            ]
        )
    return _table(["cp", "pixel rows, before -> after", "large image s, before -> after"], rows)


def host_data() -> str:
    d = _load("host_data")
    rows = []
    for r in d["results"]:
        rows.append(
            [
                str(r["dp"]),
                f"{r['before_max_ms']:.0f}",
                f"{r['turns_max_ms']:.0f}",
                f"{r['split_max_ms']:.0f}",
                f"{r['split_mean_ms']:.0f}",
                f"{r['split_plan_max_ms']:.0f}",
                str(r["split_calls"]),
                f"{r['plan_call_ms']:.2f}",
                f"{r['split_max_vs_ideal']:.2f}, {r['split_mean_vs_ideal']:.2f}",
                f"{r['split_vs_before']:.2f}",
                f"{r['split_floor_max_ms']:.0f}",
                f"{r['split_floor_max_vs_ideal']:.2f}",
                f"{r['split_imbalance']:.2f}",
                f"{r['metas_max_ms']:.0f}",
                f"{r['metas_max_vs_ideal']:.2f}",
            ]
        )
    head = ["dp", "before", "turns, slowest", "split, slowest", "split, mean"]
    head += ["of which in `plan`, slowest", "plan calls, busiest rank", "CPU ms a plan call"]
    head += ["split x dp / dp 1 (slowest, mean)", "split x dp / before", "floor"]
    head += ["floor x dp / dp 1", "slowest / mean", "metas", "metas x dp / dp 1"]
    start, end = d["load"]
    return (
        _table(head, rows)
        + f"\n\nLoad average (1 minute): {start:.1f} at the start, {end:.1f} at the end."
    )


N_NAMES = {2000: "2000", 10000: "10k", 20000: "20k", 100000: "100k"}


def _startup_runs() -> list[tuple[str, dict]]:
    """``(label suffix, row)`` of every row of the start-up runs, the quiet 100k run last."""
    out = []
    for run in _load("host_startup")["runs"]:
        out += [("", r) for r in run["rows"]]
    out += [(", quiet", r) for r in _load("host_startup_100k")["rows"]]
    return sorted(out, key=lambda sr: (sr[1]["samples"], sr[0]))


def _wall_cpu(wall: float, cpu: float, extra: str = "") -> str:
    return f"{_sig(wall)} ({_sig(cpu)}{extra})"


def host_startup() -> str:
    rows, seen = [], set()
    for suffix, r in _startup_runs():
        key = (r["samples"], suffix, r["source"])
        if "train_start_s" in r and not suffix or key in seen:
            continue  # the train start run's rows are the next table's
        seen.add(key)
        prepared = r["source"] == "prepared"
        n = r["all_sizes_measured"]
        how = f"all {N_NAMES[n]}" if n == r["samples"] else f"{n} measured, scaled"
        prepare = ""
        if "prepare_s" in r:
            prepare = (
                f"{_sig(r['prepare_s'])} ({_sig(r['prepare_cpu_s'])} CPU s:"
                f" {_sig(r['prepare_cpu_ms_per_sample'])} ms a sample); on a finished folder"
                f" {_sig(r['prepare_again_s'])}"
            )
        rows.append(
            [
                N_NAMES[r["samples"]] + suffix,
                "prepared folder" if prepared else "JSONL",
                _wall_cpu(r["open_s"], r["open_cpu_s"]),
                _wall_cpu(r["first_rows_s"], r["first_rows_cpu_s"]),
                _wall_cpu(r["all_sizes_s"], r["all_sizes_cpu_s"], f"; {how}"),
                prepare,
            ]
        )
    head = ["N", "source", "open", "processor + first window", "every sample's size"]
    loads = [f"{run['load_start']:.1f}" for run in _load("host_startup")["runs"]]
    quiet = _load("host_startup_100k")["load_start"]
    return (
        _table(head + ["prepare (2 workers)"], rows)
        + f"\n\nLoad average (1 minute) at the start of each run: {', '.join(loads)}"
        + f" (the loaded runs, in order), {quiet:.2f} (100k, quiet)."
    )


def host_train_start() -> str:
    rows = []
    for _, r in _startup_runs():
        if "train_start_s" not in r:
            continue
        source = "prepared folder" if r["source"] == "prepared" else "JSONL"
        rows.append(
            [
                f"{N_NAMES[r['samples']]}, {source} (load {r['load']:.1f})",
                _sig(r["train_start_s"]),
                _sig(r["imports_s"]),
                _sig(r["open_s"] + r["first_rows_s"], 2),
                f"{_sig(r['first_step_s'])} ({_sig(r['first_step_data_s'])})",
                _sig(r["rest_s"], 2),
            ]
        )
    head = ["N, source", "whole start", "imports", "data start", "first step (its data wait)"]
    return _table(head + ["rest"], rows)


def scale_peers() -> str:
    rows = []
    for r in _load("scale_peers")["nearest"]:
        rows.append(
            [r["peer"], r["model"], str(r["gpus"]), f"{r['max_seq']:,}", r["note"], r["source"]]
        )
    return _table(["peer", "model", "GPUs", "max sequence", "note", "source"], rows)


def _ratio(sent: float, bound: float) -> str:
    return f"{sent:.1f} / {bound:.1f} = {sent / bound:.3f}" if bound else "-"


def ep_tp_comm() -> str:
    rows = []
    for r in _load("ep_tp_comm")["rows"]:
        rows.append(
            [
                r["model"],
                f"{r['dp']} x {r['cp']} x {r['ep']} x {r['tp']}",
                f"{r['tokens']:,}",
                _ratio(r["ep_GB"], r["ep_bound_GB"]),
                _ratio(r["tp_GB"], r["tp_bound_GB"]),
                f"{r['compute_s']:.2f}",
                f"{r['ep_s']:.2f}",
                f"{r['tp_s']:.2f}",
                f"{r['fsdp_s']:.2f}",
                f"{r['step_s']:.2f}",
                f"{r['comm_%']:.1f}",
            ]
        )
    head = [
        "model",
        "dp x cp x ep x tp",
        "tokens / rank",
        "EP GB sent / bound",
        "TP GB sent / bound",
    ]
    return _table(head + ["compute s", "EP s", "TP s", "FSDP s", "step s", "comm %"], rows)


def ep_tp_measured() -> str:
    m = _load("ep_tp_comm")["measured"]
    rows = []
    for r in m["ep"]:
        rows.append(
            [
                f"EP {r['ep']}: rows sent (mean over ranks)",
                f"{r['rows_bytes_per_rank']:,.0f}",
                f"{r['bound_bytes_per_rank']:,.0f}",
                f"{r['modelled_uniform_bytes']:,.0f}",
                f"{r['all_to_alls_per_rank']} all-to-alls, {r['count_bytes_per_rank']:.0f} B of counts",
            ]
        )
    for r in m["tp"]:
        rows.append(
            [
                f"TP {r['tp']}: all-reduces ({r['layers']} layers, {r['tokens']} x {r['hidden']} fp32)",
                f"{r['sent_bytes']:,.0f}",
                f"{r['bound_bytes']:,.0f}",
                f"{r['modelled_sent_bytes']:,.0f}",
                f"{r['all_reduces']} all-reduces (modelled {r['modelled_all_reduces']})",
            ]
        )
    return _table(["measured on gloo", "bytes sent / rank", "bound", "modelled", "calls"], rows)


def ep_tp_memory() -> str:
    data = _load("ep_tp_comm")
    ours = "FSDP2 over dp x cp, checkpointing, fp32 AdamW (16 B a parameter), loss chunk 1024, text"
    rows = []
    for r in data.get("memory", []):
        simulated = r["ep"] == r["tp"] == 1  # the simulated rank itself, nothing modelled
        rows.append(
            [
                "cpvlm (simulated rank)" if simulated else "cpvlm (modelled on a simulated rank)",
                r["model"],
                f"{r['seq']:,}",
                f"{r['gpus']}: dp {r['dp']} x cp {r['cp']} x ep {r['ep']} x tp {r['tp']}",
                f"{r['modelled_peak_GiB']:.1f} GiB ({r['weights_GiB']:.1f} weights"
                + ("" if simulated else f"; simulated ep = tp = 1: {r['simulated_peak_GiB']:.1f}")
                + ")",
                f"{r['step_s']:.1f}",
                ours,
                "benchmarks/results/ep_tp_comm.json",
            ]
        )
    for p in data["published"]:
        rows.append(
            [
                p["who"],
                p["model"],
                f"{p['seq']:,}",
                f"{p['gpus']}: {p['layout']}",
                p["peak"],
                "-",
                p["settings"],
                p["source"],
            ]
        )
    head = ["who", "model", "tokens", "GPUs: layout", "peak per GPU", "step s", "settings"]
    return _table(head + ["source"], rows)


# The scale points whose memory categories docs/plan.md shows: (model, sequence, cp).
PLAN_POINTS = [("qwen3-vl-8b", "text 128k", 4), ("qwen3-vl-8b", "text 128k", 8)]


def plan_categories() -> str:
    gib = 2**30
    by = {(r["model"], r["seq"], r["cp"]): r for r in _load("scale")["rows"]}
    rows = []
    for point in PLAN_POINTS:
        r = by[point]
        m = r["memory"]
        rows.append(
            [
                str(r["cp"]),
                f"{r['saved_GiB']:.2f}",
                f"{m['saved_gathered'] / gib:.3f}",
                f"{m['loss_saved'] / gib:.3g}",
                f"{r['saved_act_GiB']:.3f}",
                f"{r['peak_GiB']:.2f}",
                f"{m['gathered'] / gib:.2f}",
                f"{m['loss'] / gib:.2f}",
            ]
        )
    head = ["cp", "saved", "of which gathered (`lm_head` weight)", "of which loss"]
    head += ["saved activations", "peak", "peak: gathered", "peak: loss"]
    return _table(head, rows)


def dynamic_cp() -> str:
    data = _load("dynamic_cp")
    rows = [
        [
            r["mix"],
            str(r["cp"]),
            str(r["rows"]),
            f"{r['static_s']:.1f}",
            f"{r['dynamic_s']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{r['no_round_speedup']:.2f}x",
            f"{r['ideal_s']:.1f}",
            f"{r['rows']} -> {r['rounds']}",
            " ".join(f"{c}:{n}" for c, n in r["sizes"].items()),
            f"{r['balance']:.3f}",
        ]
        for r in data["modelled"]
    ]
    head = ["mix", "cp", "rows", "static s", "dynamic s", "speedup", "without round costs"]
    head += ["ideal s", "rounds"]
    table = _table(head + ["rows per c (c:rows)", "balance"], rows)
    by = {(h["cp"], h["rows"]): h["plan_ms"] for h in data["host"] if h["mix"] == "text"}
    cps = sorted({cp for cp, _ in by})
    counts = sorted({n for _, n in by})
    host = [[str(n)] + [f"{by[cp, n]:.1f}" for cp in cps] for n in counts]
    load = data["config"]["load_average"]
    return (
        f"{table}\n\nPlanner host time, ms a step (text mix, process time, best of "
        f"{data['config']['repeats']}; load average {load:.1f} on 2 cores):\n\n"
        + _table(["rows"] + [f"cp {cp}" for cp in cps], host)
    )


def dynamic_cp_cpu() -> str:
    data = _load("dynamic_cp_cpu")
    rows = []
    for r in data["rows"]:
        steps = r["dynamic_cp"]
        sizes = {c: sum(s["sizes"][c] for s in steps) for c in steps[0]["sizes"]}
        rows.append(
            [
                r["mix"],
                f"{r['static tok/s']:,.0f}",
                f"{r['dynamic tok/s']:,.0f}",
                f"{r['ratio']:.2f}x",
                f"{r['static s/step']:.2f}",
                f"{r['dynamic s/step']:.2f}",
                " ".join(f"{c}:{n}" for c, n in sizes.items()),
                " / ".join(str(s["rounds"]) for s in steps),
            ]
        )
    c = data["config"]
    head = ["mix", "static tok/s", "dynamic tok/s", "ratio", "static s/step", "dynamic s/step"]
    head += [f"rows per c over {len(steps)} steps (c:rows)", "rounds a step (static: 16)"]
    load = " / ".join(f"{x:.1f}" for x in c["load_average_before"])
    return (
        _table(head, rows)
        + f"\n\n{c['rows_per_step']} rows a step, seq_len {c['seq_len']}, {c['steps']} steps "
        f"({c['warmup_steps']} warm-up); load average before the run {load} (1 / 5 / 15 min) on "
        f"{data['machine']['cpus']} cores."
    )


def _suite() -> dict:
    return _load("test_durations")


def _part(nodeid: str) -> str:
    """A test's part of the suite: its folder under tests/ (``tests/`` for the top level)."""
    module = nodeid.split("::")[0]
    return module.rsplit("/", 1)[0] + "/" if "/" in module else module


def suite_run() -> str:
    """The run the suite's tables come from: counts, wall time, machine and load."""
    run = _suite()
    m, counts = run["machine"], run["counts"]
    said = ", ".join(f"{n} {o}" for o, n in counts.items())
    return (
        f"`{run['command']}` on {run['date']}: **{said} in {run['wall_s']:.0f} s** "
        f"({run['wall_s'] / 60:.1f} minutes), {m['cores']} cores ({m['cpu']}), 1-minute load "
        f"{_load_range(m['load_1min'])} (start, end), Python {m['python']}, torch {m['torch']}, "
        f"transformers {m['transformers']}, ATen {m['aten_cpu_capability']}."
    )


def suite_parts() -> str:
    """Seconds by part of the suite and by lane (``-m "not slow"`` is the fast lane)."""
    tests = _suite()["tests"]
    total = sum(t["seconds"] for t in tests.values())
    parts: dict[str, list[float]] = {}
    for nodeid, t in tests.items():
        parts.setdefault(_part(nodeid), []).append(t["seconds"])
    rows = [
        [f"`{part}`", str(len(secs)), f"{sum(secs):.0f}", f"{100 * sum(secs) / total:.0f}%"]
        for part, secs in sorted(parts.items(), key=lambda kv: -sum(kv[1]))
    ]
    for lane in ("fast", "slow"):
        secs = [t["seconds"] for t in tests.values() if t["lane"] == lane]
        share = f"{100 * sum(secs) / total:.0f}%"
        rows.append([f"{lane} lane", str(len(secs)), f"{sum(secs):.0f}", share])
    rows.append(["all", str(len(tests)), f"{total:.0f}", "100%"])
    return _table(["part", "tests", "seconds", "share"], rows)


def suite_slowest() -> str:
    """The 15 slowest tests (setup + call + teardown: a module's first test pays its fixtures)."""
    tests = _suite()["tests"]
    slowest = sorted(tests.items(), key=lambda kv: -kv[1]["seconds"])[:15]
    rows = [[f"`{nodeid}`", t["lane"], f"{t['seconds']:.1f}"] for nodeid, t in slowest]
    return _table(["test", "lane", "seconds"], rows)


TABLES = {
    "suite_run": suite_run,
    "suite_parts": suite_parts,
    "suite_slowest": suite_slowest,
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
    "attention_impls": attention_impls,
    "attention_window": attention_window,
    "vision_modelled": vision_modelled,
    "audio_balance": audio_balance,
    "vision_measured": vision_measured,
    "vision_bytes": vision_bytes,
    "memory": memory,
    "train": train,
    "train_profile": train_profile,
    "data_loading": data_loading,
    "host_headline": host_headline,
    "host_parts": host_parts,
    "dp_measured": dp_measured,
    "split_decode": split_decode,
    "host_data": host_data,
    "host_startup": host_startup,
    "host_train_start": host_train_start,
    "scale_peers": scale_peers,
    "plan_categories": plan_categories,
    "ep_tp_comm": ep_tp_comm,
    "ep_tp_measured": ep_tp_measured,
    "ep_tp_memory": ep_tp_memory,
    "dynamic_cp": dynamic_cp,
    "dynamic_cp_cpu": dynamic_cp_cpu,
}


def render(text: str) -> str:
    """``text`` with every generated block replaced by what the JSON gives now."""

    def fill(m: re.Match) -> str:
        return m.group(1) + TABLES[m.group(2)]() + "\n" + m.group(4)

    return BLOCK.sub(fill, text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a page is not up to date")
    args = p.parse_args()
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = render(text)
        if new == text:
            continue
        stale.append(page)
        if not args.check:
            page.write_text(new)
    if args.check and stale:
        for page in stale:
            print(f"{page.relative_to(ROOT)} is out of date: run python docs/gen_benchmarks.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
