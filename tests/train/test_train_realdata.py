"""``cpvlm train --model DIR --data PATH`` on conversations with images and a video.

A tiny Qwen3-VL checkpoint directory with its processor files (``cpvlm.hf.tiny_checkpoint``),
PNG images, frame folders and a JSONL of conversations, trained through the command users run.
Tolerances: float64 1e-10 relative for CP=2 against CP=1 (the CP run sums the same terms in
another order, ~1e-16 per operation over three steps); the datasets folder and the resumed run
read the same samples and decode the same pixels, so their losses are bit-identical to the JSONL
run's (asserted with ==).
"""

import json
from pathlib import Path

import pytest

from cpvlm.hf.tiny_checkpoint import example_records, make_tiny_checkpoint, write_jsonl
from cpvlm.train.command import main as train_main

FLAGS = ["--seq-len", "160", "--dtype", "float64", "--steps", "4", "--pack-window", "8"]


def _train(out, *flags):
    assert train_main(["--out", str(out), *FLAGS, *flags]) == 0
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _datasets_copy(records, folder: Path) -> Path:
    """The same samples as a datasets folder: images as PNG bytes in an ``images`` column."""
    datasets = pytest.importorskip("datasets")
    rows = []
    for record in records:
        images, messages = [], []
        for m in record["messages"]:
            content = []
            for c in m["content"]:
                if c["type"] == "image":
                    images.append({"bytes": (folder / c["image"]).read_bytes(), "path": None})
                    c = {"type": "image"}
                elif c["type"] == "video":
                    c = {**c, "video": str(folder / c["video"])}
                content.append(c)
            messages.append({"role": m["role"], "content": content})
        rows.append({"messages": messages, "images": images})
    ds = datasets.Dataset.from_list(rows)
    ds = ds.cast_column("images", datasets.List(datasets.Image()))
    ds.save_to_disk(str(folder / "saved"))
    return folder / "saved"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("realdata")
    ckpt = make_tiny_checkpoint(root / "ckpt", "qwen3_vl")
    records = example_records(root / "data", 24, seed=7)
    jsonl = write_jsonl(root / "data" / "train.jsonl", records)
    return root, ckpt, jsonl, records


@pytest.fixture(scope="module")
def cp2_run(data):
    root, ckpt, jsonl, _ = data
    return _train(root / "cp2", "--model", str(ckpt), "--data", str(jsonl), "--cp", "2")


def test_cp2_equals_cp1_and_learns(data, cp2_run):
    root, ckpt, jsonl, _ = data
    one = _train(root / "cp1", "--model", str(ckpt), "--data", str(jsonl), "--cp", "1",
                 "--num-workers", "0")  # fmt: skip
    assert [r["tokens"] for r in one] == [r["tokens"] for r in cp2_run]  # the same rows
    for a, b in zip(one, cp2_run, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-10 * abs(a["loss"]), (
            a["step"],
            a["loss"],
            b["loss"],
        )
    assert cp2_run[-1]["loss"] < cp2_run[0]["loss"]
    assert all(r["bad_samples"] == 0 and r["rows_replaced"] == 0 for r in cp2_run)
    assert sum(r["rows"] > r["rows_text_only"] for r in cp2_run) >= 3  # images in most steps


def test_datasets_folder_trains_to_the_same_losses(data, cp2_run):
    root, ckpt, _, records = data
    saved = _datasets_copy(records, root / "data")
    run = _train(root / "ds", "--model", str(ckpt), "--data", str(saved), "--cp", "2")
    assert [r["loss"] for r in run] == [r["loss"] for r in cp2_run]


def test_stop_and_resume_mid_epoch_equals_the_uninterrupted_run(data, cp2_run):
    root, ckpt, jsonl, _ = data
    flags = ["--model", str(ckpt), "--data", str(jsonl), "--cp", "2", "--ckpt-every", "2"]
    out = root / "resumed"
    assert train_main(["--out", str(out), *FLAGS[:-2], "--pack-window", "8", *flags,
                       "--steps", "2"]) == 0  # fmt: skip
    resumed = _train(out, *flags, "--resume")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in cp2_run]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in cp2_run]


def _bad_data(root: Path, jsonl: Path) -> Path:
    lines = jsonl.read_text().splitlines()
    folder = jsonl.parent
    good = json.loads(lines[1])  # an image sample
    png = folder / good["messages"][0]["content"][0]["image"]
    (folder / "img" / "cut.png").write_bytes(png.read_bytes()[: len(png.read_bytes()) // 2])

    def with_image(name):
        r = json.loads(lines[1])
        r["messages"][0]["content"][0]["image"] = name
        return json.dumps(r)

    no_answer = json.loads(lines[0])
    no_answer["messages"] = no_answer["messages"][:1]
    long = json.loads(lines[0])
    long["messages"][0]["content"] = [{"type": "image", "image": "img/s1_0.png"}] + [
        {"type": "text", "text": "Describe the image. " * 40}
    ]
    bad = [
        with_image("img/missing.png"),  # line 1: missing_media
        "{not json",  # line 2: bad_record
        json.dumps(no_answer),  # line 3: no_assistant_turn
        json.dumps(long),  # line 4: too_long (with an image: never cut)
        json.dumps({"input_ids": [1, 2, 99999]}),  # line 5: out_of_vocab
        json.dumps({"input_ids": [40, 41, 15, 42], "image_grid_thw": [[1, 2, 2]],
                    "pixel_values": [[0.0] * 384] * 4}),  # line 6: 15 is not the image id
        with_image("img/cut.png"),  # line 7: decodes only on its rank: unreadable_media
    ]  # fmt: skip
    path = folder / "bad.jsonl"
    path.write_text("\n".join(bad + lines[:6]) + "\n")  # 13 lines: one window of 13
    return path


def test_bad_samples_are_skipped_and_logged_or_stop_the_run_under_strict(data, capsys):
    root, ckpt, jsonl, _ = data
    path = _bad_data(root, jsonl)
    flags = ["--model", str(ckpt), "--data", str(path), "--cp", "2", "--no-shuffle",
             "--pack-window", "13", "--steps", "2", "--seq-len", "160", "--dtype", "float64"]  # fmt: skip
    out = root / "bad"
    assert train_main(["--out", str(out), *flags]) == 0
    logged = [json.loads(x) for x in (out / "data_errors.jsonl").read_text().splitlines()]
    assert sorted((e["where"], e["reason"]) for e in logged) == [
        ("bad.jsonl line 1", "missing_media"),
        ("bad.jsonl line 2", "bad_record"),
        ("bad.jsonl line 3", "no_assistant_turn"),
        ("bad.jsonl line 4", "too_long"),
        ("bad.jsonl line 5", "out_of_vocab"),
        ("bad.jsonl line 6", "vision_token_mismatch"),
        ("bad.jsonl line 7", "unreadable_media"),
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert sum(summary["bad_samples"].values()) == 7 and summary["rows_replaced"] == 1

    # Resumed to step 4, the log and the counts are those of an uninterrupted 4-step run (the
    # second epoch's bad samples logged once, the first epoch's kept from before the stop).
    more = [*flags[:-6], "--steps", "4", *flags[-4:]]
    assert train_main(["--out", str(out), *more, "--resume"]) == 0
    assert train_main(["--out", str(root / "bad4"), *more]) == 0
    logs = [
        sorted(tuple(e.values()) for e in map(json.loads, (d / "data_errors.jsonl").open()))
        for d in (out, root / "bad4")
    ]
    assert logs[0] == logs[1] and len(logs[0]) >= 7
    summaries = [json.loads((d / "summary.json").read_text()) for d in (out, root / "bad4")]
    assert summaries[0]["bad_samples"] == summaries[1]["bad_samples"]
    assert sum(summaries[0]["bad_samples"].values()) == len(logs[0])
    capsys.readouterr()
    assert train_main(["--out", str(root / "strict"), *flags, "--strict"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "cpvlm train: bad data (--strict): bad.jsonl line 1: missing_media: no such file "
        f"{path.parent / 'img' / 'missing.png'}"
    ]
