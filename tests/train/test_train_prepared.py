"""``cpvlm prepare`` and ``cpvlm train --data PREPARED``.

A tiny Qwen3-VL checkpoint directory with its processor files, conversations with images and
videos (and two bad records) in a JSONL file, prepared once with two worker processes. Training
from the prepared folder reads the same plans as training from the JSONL file, so the float64
CP=2 losses and gradient norms are bit-identical (asserted with ==), as are the bad samples
logged; a prepared folder is refused by a run whose processor, template or flags differ.
"""

import json
import shutil
from pathlib import Path

import pytest

from cpvlm.cli import main as cpvlm_main
from cpvlm.data import DataError, open_source
from cpvlm.data.meta import SampleMeta
from cpvlm.data.prepared import PreparedSource, shard_path
from cpvlm.hf.tiny_checkpoint import example_records, make_tiny_checkpoint
from cpvlm.train import prepare as prepare_module
from cpvlm.train.command import main as train_main
from cpvlm.train.prepare import PrepareConfig, prepare_dataset

FLAGS = ["--seq-len", "160", "--dtype", "float64", "--steps", "3", "--pack-window", "8"]


def _train(out, *flags):
    assert train_main(["--out", str(out), *FLAGS, *flags]) == 0
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    ckpt = make_tiny_checkpoint(root / "ckpt", "qwen3_vl")
    records = example_records(root / "data", 22, seed=3)
    bad = json.loads(json.dumps(records[1]))
    bad["messages"][0]["content"][0]["image"] = "img/missing.png"
    lines = [json.dumps(r) for r in records]
    lines[5:5] = [json.dumps(bad), "{not json"]  # lines 6 and 7: missing_media, bad_record
    jsonl = root / "data" / "train.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    out = root / "cache"
    argv = ["prepare", "--model", str(ckpt), "--data", str(jsonl), "--out", str(out),
            "--workers", "2", "--shard-size", "5"]  # fmt: skip
    assert cpvlm_main(argv) == 0
    return root, ckpt, jsonl, out


def _assert_same_plans(ckpt, source, prepared) -> dict[str, str]:
    """Planning each record of ``source`` with the processor against the prepared plan and
    meta; returns the bad samples' reasons by place."""
    from cpvlm.hf.data.processor import ChatEncoder
    from cpvlm.train.launcher import model_config

    encoder = ChatEncoder(ckpt, model_config(str(ckpt)))
    assert isinstance(prepared, PreparedSource) and len(prepared) == len(source)
    reasons = {}
    for i in range(len(source)):
        cached, record = prepared[i], None
        try:
            record = source[i]  # the line that is not JSON raises here
            want = encoder.plan(record)
        except DataError as err:
            where = err.where or record.where
            with pytest.raises(DataError) as got:
                prepared.plan(cached)
            assert (got.value.reason, got.value.detail) == (err.reason, err.detail)
            with pytest.raises(DataError) as got:
                prepared.meta(i)
            assert got.value.where == where == cached.where
            reasons[where] = err.reason
            continue
        assert cached.where == record.where
        plan = prepared.plan(cached)
        assert plan.input_ids.dtype == want.input_ids.dtype
        assert plan.input_ids.tolist() == want.input_ids.tolist()
        assert plan.labels.tolist() == want.labels.tolist()
        assert (plan.images, plan.videos) == (want.images, want.videos)
        grids = (tuple(it.grid for it in want.images), tuple(it.grid for it in want.videos))
        assert prepared.meta(i) == SampleMeta(len(want), *grids)
    return reasons


def test_prepared_plans_and_meta_equal_planning_the_source(data):
    _, ckpt, jsonl, out = data
    prepared = open_source(str(out))
    reasons = _assert_same_plans(ckpt, open_source(str(jsonl)), prepared)
    assert reasons == {"train.jsonl line 6": "missing_media", "train.jsonl line 7": "bad_record"}
    assert sum(bool(prepared.meta(i).video_grids) for i in range(24) if i not in (5, 6)) >= 3


def test_images_as_bytes_are_kept_in_the_prepared_folder(data, tmp_path):
    """A parquet file whose images are encoded bytes (datasets' image column layout)."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    _, ckpt, jsonl, _ = data
    rows = []
    for line in jsonl.read_text().splitlines()[:5]:
        record, images = json.loads(line), []
        for c in record["messages"][0]["content"]:
            if c["type"] == "image":
                images.append({"bytes": (jsonl.parent / c.pop("image")).read_bytes(), "path": None})
            elif c["type"] == "video":
                c["video"] = str(jsonl.parent / c["video"])
        rows.append({"messages": record["messages"], "images": images})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    prepare_dataset(
        PrepareConfig(
            model=str(ckpt), data=str(tmp_path / "train.parquet"), out=tmp_path / "p", workers=1
        )
    )
    prepared = open_source(str(tmp_path / "p"))
    assert _assert_same_plans(ckpt, open_source(str(tmp_path / "train.parquet")), prepared) == {}
    assert any(it.image.data for i in range(5) for it in prepared.plan(prepared[i]).images)


def test_train_from_prepared_equals_train_from_jsonl_cp2(data):
    root, ckpt, jsonl, out = data
    a = _train(root / "jsonl", "--model", str(ckpt), "--data", str(jsonl), "--cp", "2")
    b = _train(root / "cached", "--model", str(ckpt), "--data", str(out), "--cp", "2")
    for key in ("loss", "grad_norm", "tokens", "rows", "bad_samples"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert sum(r["bad_samples"] for r in b) >= 1
    assert sum(r["rows"] > r["rows_text_only"] for r in b) >= 2  # images or videos in most steps
    errors = [(root / run / "data_errors.jsonl").read_text() for run in ("jsonl", "cached")]
    assert errors[0] == errors[1]


def test_dynamic_cp_from_prepared_gives_the_losses_of_jsonl_cp1(data):
    """``--dynamic-cp`` plans from the rows the prepared folder gives, with one sample a row
    (``--pack-window 1``: rows of varied length, CP sizes 1 and 2 at a budget of 80 tokens): the
    float64 losses of the one-process run on the JSONL file, relative 1e-10 (the CP run sums the
    same terms in another order)."""
    root, ckpt, jsonl, out = data
    flags = ["--model", str(ckpt), "--pack-window", "1", "--grad-accum", "4"]
    one = _train(root / "jsonl_cp1", *flags, "--data", str(jsonl), "--cp", "1")
    dyn = _train(root / "cached_dyn", *flags, "--data", str(out), "--cp", "2", "--dynamic-cp")
    for key in ("tokens", "rows", "bad_samples"):
        assert [r[key] for r in dyn] == [r[key] for r in one], key
    for a, b in zip(one, dyn, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-10 * abs(a["loss"]), (a, b)
    sizes = [r["dynamic_cp"]["sizes"] for r in dyn]
    assert sum(s.get("1", 0) for s in sizes) > 0 and sum(s.get("2", 0) for s in sizes) > 0, sizes
    assert sum(r["rows"] > r["rows_text_only"] for r in dyn) >= 2  # images or videos in most steps


def _edit_json(path: Path, edit) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


@pytest.mark.parametrize("change", ["flag", "template", "processor", "model"])
def test_another_processor_template_or_flag_is_refused_naming_it(data, tmp_path, capsys, change):
    _, ckpt, _, out = data
    flags, absent = [], ["tokenizer:", "processor:", "processor_config:"]
    if change == "flag":
        flags = ["--train-on", "all", "--max-pixels", "50000"]
        named = ["train_on (--train-on): prepared with 'assistant', this run 'all'",
                 "max_pixels (--max-pixels): prepared with None, this run 50000"]  # fmt: skip
    elif change == "model":  # a checkpoint of another family: its processor class and ids
        ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "gemma3")
        named = ["processor: prepared with 'Qwen3VLProcessor', this run '",
                 "model_type: prepared with 'qwen3_vl', this run '"]  # fmt: skip
        absent = []
    else:
        other = tmp_path / "ckpt"
        shutil.copytree(ckpt, other)
        ckpt = other
    if change == "template":
        for name in ("chat_template.jinja", "tokenizer_config.json", "chat_template.json"):
            path = other / name
            if path.is_file() and name.endswith(".jinja"):
                path.write_text(path.read_text() + "{# another template #}")
            elif path.is_file() and "chat_template" in (d := json.loads(path.read_text())):
                d["chat_template"] += "{# another template #}"
                path.write_text(json.dumps(d))
        named = ["chat_template: prepared with"]
    elif change == "processor":  # the image processor's resize limit; a tokenizer setting
        size = {"shortest_edge": 1024, "longest_edge": 8192}
        _edit_json(
            other / "processor_config.json", lambda d: d["image_processor"].update(size=size)
        )
        _edit_json(other / "tokenizer_config.json", lambda d: d.update(model_max_length=4096))
        named = ["processor_config: prepared with", "tokenizer: prepared with"]
        absent = ["processor:", "chat_template:"]
    argv = ["--out", str(tmp_path / "run"), *FLAGS, "--model", str(ckpt), "--data", str(out)]
    assert train_main([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert "cpvlm train: error: data.source" in err and "(--data)" in err, err
    for fragment in named:
        assert fragment in err, err
    for fragment in absent:
        assert fragment not in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_interrupted_prepare_resumes_to_the_same_folder(data, tmp_path, monkeypatch):
    _, ckpt, jsonl, whole = data
    out = tmp_path / "cache"
    real, calls = prepare_module._prepare_shard, []

    def interrupted(k):
        if len(calls) == 2:
            (out / "shards" / "shard-00003.arrow.123.tmp").write_bytes(b"half a shard")
            raise KeyboardInterrupt
        calls.append(k)
        return real(k)

    monkeypatch.setattr(prepare_module, "_prepare_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(
            PrepareConfig(
                model=str(ckpt), data=str(jsonl), out=out, workers=1, shard_size=5, progress=False
            )
        )
    monkeypatch.undo()
    with pytest.raises(ValueError, match="did not finish"):
        PreparedSource(out)
    assert sorted(p.name for p in (out / "shards").iterdir()) == [
        "shard-00000.arrow",
        "shard-00001.arrow",
        "shard-00003.arrow.123.tmp",
    ]
    prepare_dataset(  # resumes
        PrepareConfig(model=str(ckpt), data=str(jsonl), out=out, workers=1, progress=False)
    )
    names = sorted(p.name for p in (out / "shards").iterdir())
    assert names == sorted(p.name for p in (whole / "shards").iterdir())
    for k in range(len(names)):
        assert shard_path(out, k).read_bytes() == shard_path(whole, k).read_bytes(), k
    manifests = [json.loads((d / "prepared.json").read_text()) for d in (out, whole)]
    assert manifests[0] == manifests[1]


def test_prepare_refuses_what_it_cannot_resume_or_read(data, tmp_path, capsys):
    _, ckpt, jsonl, out = data
    argv = ["prepare", "--model", str(ckpt), "--data", str(jsonl), "--out", str(out)]
    assert cpvlm_main([*argv, "--train-on", "all"]) == 2
    err = capsys.readouterr().err
    assert "holds a prepared dataset made otherwise" in err and "train_on" in err, err
    assert "--overwrite" in err
    assert cpvlm_main([*argv[:-1], str(tmp_path / "x"), "--model", str(tmp_path)]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cpvlm_main(["prepare", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for fragment in ("--model DIR", "--workers N", "(default: all cores)", "resumes"):
        assert fragment in text, fragment
    assert "(default: None)" not in text and "(default: False)" not in text


def test_a_cache_of_an_older_format_is_refused_naming_both_formats(data, tmp_path, capsys):
    """Format 1 wrote LLaVA-OneVision videos with a grid that held their kind; format 2 reads an
    item's kind from its column, so a format-1 folder is refused, not misread."""
    from cpvlm.data.prepared import FORMAT_VERSION

    _, ckpt, _, out = data
    old = tmp_path / "old"
    shutil.copytree(out, old)
    manifest = json.loads((old / "prepared.json").read_text())
    assert manifest["format"] == FORMAT_VERSION == 2
    manifest["format"] = 1
    (old / "prepared.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="prepared with cache format 1, this cpvlm reads format 2"):
        PreparedSource(old)
    argv = ["--model", str(ckpt), "--data", str(old), "--out", str(tmp_path / "run"), *FLAGS]
    assert train_main(argv) != 0
    err = capsys.readouterr().err
    assert "cache format 1" in err and "run cpvlm prepare again" in err, err
