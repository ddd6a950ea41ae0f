"""Per-rank memory of one ContextParallelVLM forward+backward on a long packed row, CP 1, 2, 4.

    python benchmarks/memory.py                 # S = 16472; 3 CPU-minutes, 3-5 minutes on 2 cores
    python benchmarks/memory.py --table vocab   # vocabulary 152064, S = 4096, loss chunked or not
    python benchmarks/memory.py --cp 2 --docs 1 --out-dir DIR  # a trial run: one document

--table vocab: the same model with a real vocabulary (152064, Qwen's) on a text-heavy row of
4096 tokens (4 documents, 1152 visual tokens), each CP size twice: the loss from the whole local
logits (``loss_chunk=None``: ``lm_head`` makes [S_loc, V] logits, the loss copies their valid
rows and takes a log-softmax of them) and chunked (``loss_chunk=1024``: at most 1024 rows of
logits exist at once, recomputed in the backward). Same measurements; "chunk/whole" is the
chunked over the whole-logits figure at one cp. Writes memory_vocab.json.

Model: Qwen3-VL (deepstack on), random weights, float32; text hidden 256, MLP 768, 4 layers, 8/2
query/key heads of 32, vocab 4096; vision hidden 128, MLP 512, depth 2, patch 8, merge 2.
Batch: one row of 12 packed documents, each with 400-1000 text tokens and one or two images from
8x8 to 32x32 merged tokens, or a video of 8 temporal patch-frames of 16x16 merged tokens:
8400 visual tokens (33600 patches) in S = 16472 tokens.
Every row of the table is one forward+backward on fresh gloo processes (1 thread each), ring
attention. The scalable flow routes vision rows to their owners (vision="route"); the
compatibility flow all-gathers them and builds the full inputs_embeds (vision="allgather",
flow="compat").

CPU has no allocator peak counter, so the step is measured three ways, on every rank:
- saved_MiB: bytes saved for backward when the forward ends (the activation memory proper), from
  the public ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves, counted
  once per storage while it is alive, parameters and buffers excluded.
- peak_MiB: the peak of live bytes allocated during the step, forward and backward, parameter
  gradients excluded (model-sized, the same at every CP size: grad_MiB). A TorchDispatchMode sees
  every aten op; a storage that an op returns and that none of its inputs holds is a new
  allocation, counted until ``weakref.finalize`` on the storage reports it freed. It misses
  scratch memory that kernels allocate and free inside one op (the flash attention and
  cross-entropy workspaces) and gloo's transport buffers. peak_at: where the peak happened.
- rss_MiB: the process's peak RSS (``resource.getrusage``) minus its RSS before the step, in a
  fresh process: a coarse cross-check that also holds allocator slack and kernel scratch. It is a
  lower bound where the process had a higher peak before the step (rss_valid false in the JSON).
Values are the max over ranks. "x cp" is the ratio to CP=1 times cp: 1.000 means the per-rank
memory falls exactly as 1/cp. "scal/comp" is the scalable over the compatibility flow at one cp.
Not counted: what every rank holds before the step, the full batch (in_MiB, mostly pixels) and
the model. Then the live bytes at the peak are split by origin: the module that made them in the
forward (vision, embed, layer<i>, norm, lm_head), "loss" after the head, "glue" for the rest
(ContextParallelVLM and EncoderDataParallel between modules: batch preparation, vision row
collectives, scatter into the embeddings, shard, rotary tables), "backward"; the largest live
tensors at the peak are listed; and every float tensor with a dimension of full sequence length
(S or padded) that a rank allocated: the scalable flow must have none. That check does not see
the full sequence split over another dimension (the all-gather attention's K/V of all ranks,
[W*2, B, Hkv, S_loc, D], by design); the by-origin table does.
"""

from __future__ import annotations

import json
import resource
import sys
import time
import weakref
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from cpvlm.distributed.compat import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import parser, print_table, write_json  # noqa: E402

from cpvlm import CPOptions, ShardPlan  # noqa: E402
from cpvlm.testing import DistributedTestError, run_distributed, shutdown_pools  # noqa: E402

MiB = 2**20
TEXT = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 32768,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5_000_000.0,
        "mrope_section": [8, 4, 4],
        "mrope_interleaved": True,
    },
}
VISION = {
    "depth": 2,
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_heads": 4,
    "out_hidden_size": 256,
    "num_position_embeddings": 1024,
}
# One packed document: (images as (h, w) patches, videos as (t, h, w), text tokens); a grid gives
# t*h*w / 4 merged tokens.
DOCS = [
    (((32, 32),), (), 700),
    (((64, 48), (16, 16)), (), 500),
    ((), ((8, 32, 32),), 400),
    (((48, 48),), (), 900),
    (((24, 40), (40, 24)), (), 600),
    (((64, 64),), (), 400),
    (((32, 64), (16, 32)), (), 800),
    (((56, 56),), (), 500),
    (((16, 16), (32, 32)), (), 1000),
    (((48, 32),), (), 700),
    (((40, 40), (24, 24)), (), 600),
    (((64, 32),), (), 900),
]
FLOWS = {"scalable": ("route", "scalable"), "compat": ("allgather", "compat")}
VOCAB = 152064  # Qwen2.5-VL / Qwen3-VL
VOCAB_DOCS = [  # 4096 tokens, 1152 of them visual
    (((32, 32),), (), 700),
    (((48, 48),), (), 900),
    (((16, 16), (32, 32)), (), 1000),
    ((), (), 336),
]
LOSS_CHUNK = 1024


# transformers is imported where it is used: the spawned workers import this script first, and
# on a busy machine four of them importing transformers can outlast the worker pool's start-up.


def model_config(vocab: int | None = None):
    from cpvlm.hf import TINY_MODELS

    text = dict(TEXT) if vocab is None else {**TEXT, "vocab_size": vocab}
    return TINY_MODELS["qwen3-vl-tiny"](text_config=text, vision_config=dict(VISION))


def packed_batch(config, docs=DOCS) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The documents ``docs`` packed into one row, as a packing collator would lay them out."""
    from cpvlm.hf import SampleSpec, synthetic_batch

    parts = [
        synthetic_batch(config, [SampleSpec(*doc)], seed=100 + i) for i, doc in enumerate(docs)
    ]
    batch = {}
    for key in ("input_ids", "labels", "mm_token_type_ids"):
        batch[key] = torch.cat([p[key] for p in parts], dim=1)
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        present = [p[key] for p in parts if key in p]
        if present:
            batch[key] = torch.cat(present)
    return batch, [p["input_ids"].shape[1] for p in parts]


def _flat_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _flat_tensors(item)
    elif isinstance(obj, dict):
        yield from _flat_tensors(list(obj.values()))


class StepMemory(TorchDispatchMode):
    """Live bytes allocated by aten ops while active, with their peak, and bytes saved for backward.

    A storage counts from the op that first returns it (and whose inputs do not hold it: views and
    in-place results are not allocations) until its finalizer runs. Parameter gradients move to
    their own tally when they land in ``.grad``. ``where`` labels allocations for the breakdown.
    """

    def __init__(self, model: torch.nn.Module, full_lens: set[int]):
        super().__init__()
        self.full_lens = full_lens
        self.where = "setup"
        self.records: list[dict] = []
        self.live: dict[int, dict] = {}  # id(storage) -> record
        self.saved: dict[int, tuple[int, str]] = {}  # id(storage) -> (bytes, where)
        self.event = 0
        self.act = self.grad = 0
        self.peak_act = self.peak_total = self.peak_event = 0
        self.peak_where = ""
        self.full_len_floats: list[dict] = []
        self._excluded = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._grad_landed)

    # -- live bytes -------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = {
            id(t.untyped_storage())
            for t in _flat_tensors((args, kwargs))
            if t.layout == torch.strided
        }
        for t in _flat_tensors(out):
            if t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            key = id(storage)
            record = self.live.get(key)
            if record is not None:
                self._resize(record, storage.nbytes())
            elif key not in held and key not in self._excluded:
                self._allocate(key, storage, t, func)
        return out

    def _allocate(self, key, storage, t, func):
        record = {
            "bytes": storage.nbytes(),
            "where": self.where,
            "op": func.__name__.split(".")[0],
            "shape": tuple(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."),
            "start": self.event,
            "end": None,
            "grad": False,
            "grad_at": None,
        }
        self.records.append(record)
        self.live[key] = record
        weakref.finalize(storage, self._free, key)
        self.act += record["bytes"]
        if t.is_floating_point() and self.full_lens.intersection(t.shape):
            self.full_len_floats.append({k: record[k] for k in ("where", "op", "shape", "bytes")})
        self._tick()

    def _resize(self, record, nbytes):
        if nbytes != record["bytes"]:
            delta, record["bytes"] = nbytes - record["bytes"], nbytes
            if record["grad"]:
                self.grad += delta
            else:
                self.act += delta
            self._tick()

    def _free(self, key):
        record = self.live.pop(key)
        record["end"] = self.event
        if record["grad"]:
            self.grad -= record["bytes"]
        else:
            self.act -= record["bytes"]
        self._tick()

    def _grad_landed(self, param):
        record = self.live.get(id(param.grad.untyped_storage()))
        if record is not None and not record["grad"]:
            record["grad"], record["grad_at"] = True, self.event
            self.act -= record["bytes"]
            self.grad += record["bytes"]

    def _tick(self):
        self.event += 1
        if self.act > self.peak_act:
            self.peak_act, self.peak_event, self.peak_where = self.act, self.event, self.where
        self.peak_total = max(self.peak_total, self.act + self.grad)

    def _live_at_peak(self) -> list[dict]:
        return [
            r
            for r in self.records
            if r["start"] < self.peak_event
            and (r["end"] is None or r["end"] >= self.peak_event)
            and (r["grad_at"] is None or r["grad_at"] >= self.peak_event)
        ]

    def at_peak(self) -> dict[str, int]:
        """Bytes live at the activation peak, by where they were allocated."""
        parts = defaultdict(int)
        for r in self._live_at_peak():
            parts[r["where"]] += r["bytes"]
        return dict(parts)

    def largest_at_peak(self, n: int) -> list[dict]:
        """The n largest tensors live at the peak, and the n largest of each origin."""
        live = sorted(self._live_at_peak(), key=lambda r: -r["bytes"])
        by_where = defaultdict(list)
        for r in live:
            by_where[r["where"]].append(r)
        keep = {id(r) for r in live[:n]} | {id(r) for rs in by_where.values() for r in rs[:n]}
        fields = ("bytes", "where", "op", "dtype", "shape")
        return [{k: r[k] for k in fields} for r in live if id(r) in keep]

    # -- saved for backward -----------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided:
            storage = t.untyped_storage()
            key = id(storage)
            if key not in self._excluded and key not in self.saved:
                self.saved[key] = (storage.nbytes(), self.where)
                weakref.finalize(storage, self.saved.pop, key, None)
        return t

    def saved_by_where(self) -> dict[str, int]:
        parts = defaultdict(int)
        for nbytes, where in self.saved.values():
            parts[where] += nbytes
        return dict(parts)


def _label(model, tracker: StepMemory) -> None:
    """Name forward allocations after the module that makes them ("glue" between modules)."""
    from cpvlm.hf import adapter_for

    adapter = adapter_for(model)
    modules = {"vision": adapter.vision_tower(model), "embed": adapter.embed_tokens(model)}
    modules.update({f"layer{i}": layer for i, layer in enumerate(adapter.decoder_layers(model))})
    modules.update({"norm": adapter.text_model(model).norm, "lm_head": adapter.lm_head(model)})

    def hooks(name):
        # After the final norm comes the head and the loss (the chunked loss calls no lm_head).
        after = "loss" if name in ("lm_head", "norm") else "glue"

        def enter(module, args):
            tracker.where = name

        def leave(module, args, output):
            tracker.where = after

        return enter, leave

    for name, module in modules.items():
        enter, leave = hooks(name)
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status (this script reads Linux process memory)")


def _worker(rank, world_size, flow, attn, docs, vocab=None, loss_chunk=None):
    from transformers import AutoModelForImageTextToText

    from cpvlm.hf import ContextParallelVLM

    torch.manual_seed(0)
    config = model_config(vocab)
    model = AutoModelForImageTextToText.from_config(config).train()
    batch, doc_lens = packed_batch(config, docs)
    vision, flow_name = FLOWS[flow]
    options = CPOptions(attn=attn, vision=vision, flow=flow_name)
    cp_model = ContextParallelVLM(model, dist.group.WORLD, options=options, loss_chunk=loss_chunk)
    plan = ShardPlan(batch["input_ids"].shape[1], world_size, doc_lens=doc_lens)
    # At CP=1 the local length is the full length: nothing to flag.
    tracker = StepMemory(model, {plan.seq_len, plan.padded_len} if world_size > 1 else set())
    _label(model, tracker)
    dist.barrier()
    rss_before = _rss_now()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    with tracker, torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
        tracker.where = "glue"
        out = cp_model(**batch, doc_lens=doc_lens)
        saved = tracker.saved_by_where()
        tracker.where = "backward"
        out.loss.backward()
    seconds = time.perf_counter() - t0
    maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.barrier()
    return {
        "seconds": seconds,
        "local_len": plan.local_len,
        "local_visual_tokens": out.local_visual_tokens,
        "encoded_units": out.encoded_units,
        "saved": saved,
        "peak_act": tracker.peak_act,
        "peak_total": tracker.peak_total,
        "peak_phase": tracker.peak_where,
        "at_peak": tracker.at_peak(),
        "largest_at_peak": tracker.largest_at_peak(6),
        "rss": maxrss_after - rss_before,
        # The step set the process's high-water mark (else the RSS figure is a lower bound).
        "rss_valid": maxrss_after > maxrss_before,
        "grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()),
        "input_bytes": sum(t.numel() * t.element_size() for t in batch.values()),
        "full_len_floats": tracker.full_len_floats,
    }


def _mib(n: float) -> float:
    return n / MiB


def _run_with_retries(cp, attn, docs, vocab, chunk, tries=3):
    """run_distributed, starting the pool again when its workers were too slow to start (each
    imports transformers; on a busy machine four of them can take longer than the pool waits)."""
    for attempt in range(tries):
        try:
            return run_distributed(_worker, cp, "scalable", attn, docs, vocab, chunk, timeout=1800)
        except DistributedTestError as err:
            if "could not start" not in str(err) or attempt + 1 == tries:
                raise
            print(f"cp={cp}: workers slow to start, trying again", flush=True)


def _vocab_row(cp: int, name: str, ranks: list[dict]) -> dict:
    worst = max(ranks, key=lambda r: r["peak_act"])
    return {
        "cp": cp,
        "loss": name,
        "S_loc": ranks[0]["local_len"],
        "saved_MiB": _mib(max(sum(r["saved"].values()) for r in ranks)),
        "peak_MiB": _mib(worst["peak_act"]),
        "loss_at_peak_MiB": _mib(worst["at_peak"].get("loss", 0)),
        "rss_MiB": _mib(max(r["rss"] for r in ranks)),
        "peak_at": "/".join(sorted({r["peak_phase"] for r in ranks})),
        "grad_MiB": _mib(ranks[0]["grad_bytes"]),
        "seconds": max(r["seconds"] for r in ranks),
    }


def vocab_table(args) -> None:
    """Whole local logits vs the chunked loss at a 152k vocabulary, cp 1/2/4 (scalable flow).

    Each row is printed as it is measured; rows of other cp sizes already in memory_vocab.json
    (from a run with other --cp) are kept, so that a long table can be measured in parts.
    """
    docs = VOCAB_DOCS[: args.docs]
    batch, doc_lens = packed_batch(model_config(VOCAB), docs)
    seq_len = batch["input_ids"].shape[1]
    n_visual = int((batch["mm_token_type_ids"] != 0).sum())
    print(f"vocab {VOCAB}, S={seq_len} tokens, {n_visual} visual tokens", flush=True)
    path = args.out_dir / "memory_vocab.json"
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    rows = [r for r in old if r["cp"] not in args.cp]
    for cp in args.cp:
        for name, chunk in {"whole": None, "chunked": LOSS_CHUNK}.items():
            ranks = _run_with_retries(cp, args.attn, docs, VOCAB, chunk)
            shutdown_pools()
            rows.append(_vocab_row(cp, name, ranks))
            print({k: rows[-1][k] for k in ("cp", "loss", "peak_MiB", "saved_MiB")}, flush=True)
    rows.sort(key=lambda r: (r["cp"], r["loss"] != "whole"))
    for row in rows:
        whole = next(r for r in rows if r["cp"] == row["cp"] and r["loss"] == "whole")
        for key in ("saved", "peak", "rss"):
            row[f"{key} chunk/whole"] = row[f"{key}_MiB"] / whole[f"{key}_MiB"]
    print()
    print_table(
        rows,
        ["cp", "loss", "S_loc", "saved_MiB", "peak_MiB", "loss_at_peak_MiB", "rss_MiB",
         "peak_at", "peak chunk/whole", "rss chunk/whole", "seconds"],
        title=f"per-rank memory, vocab {VOCAB}, S={seq_len}, float32, loss chunk {LOSS_CHUNK} "
        "rows (max over ranks)",
    )  # fmt: skip
    write_json(
        args.out_dir,
        "memory_vocab",
        {
            "config": {
                "text": {**TEXT, "vocab_size": VOCAB},
                "vision": VISION,
                "seq_len": seq_len,
                "visual_tokens": n_visual,
                "loss_chunk": LOSS_CHUNK,
                "attn": args.attn,
                "statistic": "max over ranks of one forward+backward in fresh processes",
            },
            "rows": rows,
        },
    )


def main():
    p = parser(__doc__)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--attn", default="ring", choices=["ring", "allgather"])
    p.add_argument("--table", default="sequence", choices=["sequence", "vocab"])
    p.add_argument("--docs", type=int, help="pack only the table's first DOCS documents")
    args = p.parse_args()
    if args.table == "vocab":
        vocab_table(args)
        return
    docs = DOCS[: args.docs]
    batch, doc_lens = packed_batch(model_config(), docs)
    seq_len = batch["input_ids"].shape[1]
    n_visual = int((batch["mm_token_type_ids"] != 0).sum())
    print(f"S={seq_len} tokens, {len(doc_lens)} documents, {n_visual} visual tokens", flush=True)
    results = {}
    for cp in args.cp:
        for flow in FLOWS:
            t0 = time.perf_counter()
            results[cp, flow] = run_distributed(_worker, cp, flow, args.attn, docs, timeout=1200)
            shutdown_pools()  # fresh processes for every row: a process's peak RSS only grows
            print(f"cp={cp} {flow}: {time.perf_counter() - t0:.0f}s", flush=True)

    rows = []
    for (cp, flow), ranks in results.items():
        rows.append(
            {
                "cp": cp,
                "flow": flow,
                "S_loc": ranks[0]["local_len"],
                "saved_MiB": _mib(max(sum(r["saved"].values()) for r in ranks)),
                "peak_MiB": _mib(max(r["peak_act"] for r in ranks)),
                "rss_MiB": _mib(max(r["rss"] for r in ranks)),
                "grad_MiB": _mib(ranks[0]["grad_bytes"]),
                "in_MiB": _mib(ranks[0]["input_bytes"]),
                "peak_at": "/".join(sorted({r["peak_phase"] for r in ranks})),
                "rss_valid": all(r["rss_valid"] for r in ranks),
            }
        )
    keys = ("saved", "peak", "rss")
    first = min(args.cp)
    for row in rows:
        base = next(r for r in rows if r["cp"] == first and r["flow"] == row["flow"])
        compat = next(r for r in rows if r["cp"] == row["cp"] and r["flow"] == "compat")
        for key in keys:
            row[f"{key} x cp"] = row[f"{key}_MiB"] / base[f"{key}_MiB"] * row["cp"] / first
            row[f"{key} scal/comp"] = row[f"{key}_MiB"] / compat[f"{key}_MiB"]
    print()
    print_table(
        rows,
        ["cp", "flow", "S_loc", "saved_MiB", "saved x cp", "peak_MiB", "peak x cp", "rss_MiB",
         "rss x cp", "peak_at", "grad_MiB", "in_MiB"],
        title=f"per-rank memory of one forward+backward, S={seq_len}, float32, attn={args.attn} "
        "(max over ranks; x cp = ratio to CP=1 times cp, 1.000 = exactly 1/cp)",
    )  # fmt: skip
    print()
    print_table(
        [r for r in rows if r["flow"] == "scalable"],
        ["cp", *(f"{k} scal/comp" for k in keys)],
        title="scalable / compatibility flow, same cp",
    )

    breakdown = []
    for (cp, flow), ranks in results.items():
        worst = max(ranks, key=lambda r: r["peak_act"])
        breakdown.append(
            {"cp": cp, "flow": flow, **{k: _mib(v) for k, v in worst["at_peak"].items()}}
        )
    wheres = sorted({k for r in breakdown for k in r} - {"cp", "flow"})
    print()
    print_table(
        breakdown, ["cp", "flow", *wheres], title="MiB live at the peak, by origin (worst rank)"
    )

    def describe(r: dict) -> str:
        return f"{_mib(r['bytes']):8.2f} MiB  {r['where']:>8}  {r['op']}  {r['dtype']} {list(r['shape'])}"

    largest = {}  # worst rank of each row: the largest live tensors, overall and of each origin
    for (cp, flow), ranks in results.items():
        worst = max(ranks, key=lambda r: r["peak_act"])
        largest[f"cp{cp}_{flow}"] = [describe(r) for r in worst["largest_at_peak"]]
        for r in ranks:
            del r["largest_at_peak"]
            r["full_len_floats"] = sorted(
                {f"{f['where']}:{f['op']}{list(f['shape'])}" for f in r["full_len_floats"]}
            )
    last = max(args.cp)
    for flow in FLOWS:
        lines = largest[f"cp{last}_{flow}"]
        glue = [line for line in lines if " glue " in line]
        print(f"\nlargest tensors live at the peak, cp={last} {flow} (worst rank), then glue's:")
        print("\n".join(f"  {line}" for line in [*lines[:6], "...", *glue[:6]]))

    print("\nfloat tensors of full sequence length (S or padded) allocated on a rank:")
    for (cp, flow), ranks in results.items():
        if cp > 1:
            found = sorted({f for r in ranks for f in r["full_len_floats"]})
            print(f"  cp={cp} {flow}: {', '.join(found) or 'none'}")

    write_json(
        args.out_dir,
        "memory",
        {
            "config": {
                "text": TEXT,
                "vision": VISION,
                "seq_len": seq_len,
                "visual_tokens": n_visual,
                "documents": len(doc_lens),
                "dtype": "float32",
                "attn": args.attn,
                "flows": {k: {"vision": v, "flow": f} for k, (v, f) in FLOWS.items()},
                "statistic": "max over ranks of one forward+backward in fresh processes",
            },
            "rows": rows,
            "at_peak_MiB": breakdown,
            "largest_at_peak": largest,
            "ranks": {f"cp{cp}_{flow}": ranks for (cp, flow), ranks in results.items()},
        },
    )


if __name__ == "__main__":
    main()
