"""The rank loader: global rows, DP split, decoding split over CP ranks, resume, workers, sources.

Every rank runs the same planning; these tests run the ranks of one world in one process (the
data path needs no process group) and compare what each rank gets.
"""

import json

import pytest
import torch
from transformers import AutoConfig

from cpvlm.data import (
    LoaderConfig,
    RankLoader,
    RowStream,
    dp_split,
    open_source,
    pack_window,
    parse_data_args,
)
from cpvlm.data.balance import RowCost
from cpvlm.data.dynamic_cp import plan_dynamic_cp
from cpvlm.encoders import assign_units, vision_units
from cpvlm.hf.data.processor import ChatEncoder
from cpvlm.hf.tiny_checkpoint import example_records, make_tiny_checkpoint, write_jsonl

SEQ_LEN = 192


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    ckpt = make_tiny_checkpoint(root / "ckpt", "qwen3_vl")
    encoder = ChatEncoder(ckpt, AutoConfig.from_pretrained(ckpt))
    records = example_records(root / "data", 40, seed=3)
    jsonl = write_jsonl(root / "data" / "train.jsonl", records)
    return encoder, jsonl, records


def _loader(
    encoder, source, *, dp=(0, 1), cp=(0, 1), rows=2, state=None, window=16, row_cost=None, **kw
):
    stream = RowStream(source, encoder.plan, seq_len=SEQ_LEN, window=window, seed=5)
    config = LoaderConfig(
        rows_per_step=rows, dp_rank=dp[0], dp_size=dp[1], cp_rank=cp[0], cp_size=cp[1], **kw
    )
    return RankLoader(stream, encoder.decode, encoder.ids, config, state=state, row_cost=row_cost)


def test_packing_and_dp_split_are_balanced_and_complete():
    lengths = [150, 40, 90, 100, 30, 60, 10, 192, 5]
    rows = pack_window(lengths, 192)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 192 for r in rows)
    assert len(rows) == -(-sum(lengths) // 192)  # as few rows as the tokens need here
    tokens = [192, 180, 20, 10, 150, 160]
    shares = dp_split(tokens, 3)
    assert sorted(i for s in shares for i in s) == list(range(6)) and all(
        len(s) == 2 for s in shares
    )
    loads = [sum(tokens[i] for i in s) for s in shares]
    assert max(loads) == 310  # the contiguous split's heaviest rank holds 372


def test_each_image_and_frame_is_decoded_once_per_cp_group(setup):
    """cp=4, dp=2: per step and DP replica, the four CP ranks decode disjoint media that together
    are every image and frame of the replica's rows; their pixel rows are exactly the rows of
    their units in the full decode."""
    encoder, jsonl, _ = setup
    source = open_source(str(jsonl))
    decoded_once = 0
    for d in range(2):
        ranks = [_loader(encoder, source, dp=(d, 2), cp=(c, 4)) for c in range(4)]
        full = _loader(encoder, source, dp=(d, 2), decode_mode="all")
        for _ in range(3):
            steps = [r.next_step() for r in ranks]
            whole = full.next_step()
            for k, ref in enumerate(whole):
                rows = [s[k] for s in steps]
                assert all(torch.equal(r.input_ids, ref.input_ids) for r in rows)
                names = [n for r in rows for n in r.decoded]
                assert sorted(names) == sorted(ref.decoded)  # every medium, exactly once
                decoded_once += len(names)
                if not ref.has_vision:
                    continue
                units = vision_units(ref.grid_thw, 2)
                assignment = assign_units(units.pixel_counts, 4)
                full_pixels = torch.cat(
                    [
                        ref.media[k]
                        for k in ("pixel_values", "pixel_values_videos")
                        if k in ref.media
                    ]
                )
                for c, r in enumerate(rows):
                    assert r.units == assignment[c]
                    mine = torch.cat(
                        [
                            r.media[k]
                            for k in ("pixel_values", "pixel_values_videos")
                            if k in r.media
                        ]
                    )
                    assert torch.equal(mine, full_pixels[units.pixel_index(assignment[c])])
    assert decoded_once > 20


def test_dynamic_cp_decodes_each_unit_once_on_the_block_of_its_row(setup):
    """--dynamic-cp at cp 4 (a rank's budget 48 tokens): of each row only the ranks of the block
    that runs it (the plan of the full rows) decode, each the units it encodes at the row's CP
    size; together every medium exactly once; a rank outside the block decodes nothing."""
    encoder, jsonl, _ = setup
    source = open_source(str(jsonl))
    cost = RowCost(token=1, pair=1)
    dynamic = {"dynamic_cp_tokens": SEQ_LEN // 4, "rows": 4}
    ranks = [_loader(encoder, source, cp=(c, 4), row_cost=cost, **dynamic) for c in range(4)]
    full = _loader(encoder, source, decode_mode="all", rows=4)
    sizes = set()
    for _ in range(3):
        steps = [r.next_step() for r in ranks]
        whole = full.next_step()
        costs = [cost.row(r.doc_lens, r.grid_thw.tolist()) for r in whole]
        plan = plan_dynamic_cp([r.num_tokens for r in whole], costs, 4, SEQ_LEN // 4)
        for job in (j for jobs in plan.rounds for j in jobs):
            ref, rows = whole[job.row], [s[job.row] for s in steps]
            sizes.add(job.size)
            names = [n for r in rows for n in r.decoded]
            assert sorted(names) == sorted(ref.decoded)  # every medium, exactly once
            outside = [r for c, r in enumerate(rows) if c not in job.ranks]
            assert all(r.decoded == [] and r.units == [] for r in outside)
            if not ref.has_vision:
                continue
            assignment = assign_units(vision_units(ref.grid_thw, 2).pixel_counts, job.size)
            assert [rows[c].units for c in job.ranks] == assignment
    assert len(sizes) > 1, sizes


def test_resume_continues_with_exactly_the_next_rows_at_another_dp(setup):
    encoder, jsonl, _ = setup
    source = open_source(str(jsonl))
    straight = _loader(encoder, source, rows=1)
    seen = [straight.next_step()[0].input_ids for _ in range(12)]  # past one epoch (40 samples)
    first = _loader(encoder, source, rows=1)
    for _ in range(5):
        first.next_step()
    state = first.state_dict()
    assert set(state) == {"window", "row"}
    # Resumed at dp=2 (rows per DP rank 1): the global rows continue in order, split over DP.
    resumed = [_loader(encoder, source, dp=(d, 2), rows=1, state=state) for d in range(2)]
    got = []
    for _ in range(3):
        pair = [r.next_step()[0].input_ids for r in resumed]
        got += sorted(pair, key=lambda t: [t.tolist() == s.tolist() for s in seen[5:]].index(True))
    assert all(torch.equal(a, b) for a, b in zip(got, seen[5:11], strict=True))


def test_workers_give_the_same_rows(setup):
    encoder, jsonl, _ = setup
    source = open_source(str(jsonl))
    inline = _loader(encoder, source, cp=(1, 2))
    workers = _loader(encoder, source, cp=(1, 2), num_workers=2, prefetch=2)
    for _ in range(4):
        for a, b in zip(inline.next_step(), workers.next_step(), strict=True):
            assert torch.equal(a.input_ids, b.input_ids) and a.decoded == b.decoded
            assert a.media.keys() == b.media.keys()
            assert all(torch.equal(a.media[k], b.media[k]) for k in a.media)
    assert workers.state_dict() == inline.state_dict()
    workers.close()


def test_reading_rows_leaves_torch_global_rng_alone(setup):
    """A DataLoader iterator draws its workers' base seed; from torch's global generator that
    draw would put a resumed run's RNG state one draw off the uninterrupted run's (dropout and
    every other random op after a resume would differ)."""
    encoder, jsonl, _ = setup
    source = open_source(str(jsonl))
    for kw in ({}, {"num_workers": 1, "prefetch": 1}):
        before = torch.get_rng_state()
        loader = _loader(encoder, source, **kw)
        loader.next_step()
        assert torch.equal(torch.get_rng_state(), before), kw
        loader.close()


def test_datasets_folder_parquet_and_function_give_the_same_samples(setup, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    encoder, jsonl, records = setup
    folder = jsonl.parent
    ds = datasets.Dataset.from_list(records)
    ds.save_to_disk(str(folder / "saved"))
    ds.to_parquet(str(folder / "train.parquet"))
    (tmp_path / "my_data.py").write_text(
        "import json\n"
        "def samples(path, limit, model_config=None):\n"
        "    return [json.loads(l) for l in open(path)][:limit]\n"
    )
    monkeypatch.chdir(tmp_path)
    args = parse_data_args([f"path={jsonl}", "limit=40"])
    sources = [
        open_source(str(jsonl)),
        open_source(str(folder / "saved")),
        open_source(str(folder / "train.parquet")),
        open_source("my_data:samples", data_args=args),
    ]
    base = [encoder.plan(sources[0][i]) for i in range(40)]
    for source in sources[1:]:
        assert len(source) == 40
        for i in (0, 4, 7, 19):
            record = source[i]
            if record.base_dir != jsonl.parent:  # the function's records resolve from the cwd
                record = type(record)(record.index, record.where, record.data, jsonl.parent)
            plan = encoder.plan(record)
            assert torch.equal(plan.input_ids, base[i].input_ids), (source, i)
            assert torch.equal(plan.labels, base[i].labels)


def test_data_args_parse_json_values():
    assert parse_data_args(["n=3", "name=x", "flag=true", "xs=[1,2]"]) == {
        "n": 3, "name": "x", "flag": True, "xs": [1, 2],
    }  # fmt: skip
    with pytest.raises(ValueError, match="key=value"):
        parse_data_args(["nokey"])


def test_bad_lines_are_reported_once_with_their_line(setup, tmp_path):
    encoder, jsonl, records = setup
    lines = jsonl.read_text().splitlines()
    lines[2] = "{not json"
    bad = json.loads(lines[4])
    bad["messages"] = bad["messages"][:1]  # no assistant turn
    lines[4] = json.dumps(bad)
    path = jsonl.parent / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    loader = _loader(encoder, open_source(str(path)), rows=1, window=20)
    errors = []
    while loader.state_dict()["window"] < 2:  # two windows of 20: one epoch
        errors += [e for r in loader.next_step() for e in r.errors]
    reasons = sorted((e.where, e.reason) for e in errors)
    assert reasons == [
        ("bad.jsonl line 3", "bad_record"),
        ("bad.jsonl line 5", "no_assistant_turn"),
    ]
