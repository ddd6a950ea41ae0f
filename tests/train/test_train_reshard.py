"""Resume on another topology, and export: a run saved at dp 2 x cp 2 continues at dp 1 x cp 4
and at dp 1 x cp 2 with the losses of uninterrupted runs at those topologies; its checkpoint
exported with ``cpvlm export`` loads with ``AutoModelForImageTextToText.from_pretrained`` and
holds exactly the trained weights.

The data is real: a tiny checkpoint directory with its processor (tokenizer, chat template,
image and video processor), PNG images, frame folders and a JSONL of conversations, so the
checkpoint carries the position of the global row stream that the real-data loader reads (each
rank decoding only its own units' pixels). Every topology trains on the same global batch (2
packed rows per step: dp 2 x 1 row, or dp 1 x grad-accum 2) in the same global order, so the
runs differ only in how the same sums are split over ranks. float64, 1e-10 relative: observed
~1e-15 per step (round-off of reordered sums, carried through AdamW over four steps). The export
must carry the processor files along.
"""

import json
import shutil

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from cpvlm.export import main as export_main
from cpvlm.hf.tiny_checkpoint import example_records, make_tiny_checkpoint, write_jsonl
from cpvlm.train.command import main as train_main

TOL = 1e-10
PROCESSOR_FILES = ("chat_template.jinja", "processor_config.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    ckpt = make_tiny_checkpoint(root / "ckpt", "qwen3_vl")
    jsonl = write_jsonl(root / "data" / "train.jsonl", example_records(root / "data", 16, seed=3))
    return ckpt, jsonl


def _train(out, model_dir, *flags):
    ckpt, jsonl = model_dir
    argv = ["--out", str(out), "--model", str(ckpt), "--data", str(jsonl), "--dtype", "float64"]
    argv += ["--seq-len", "160", "--pack-window", "8", "--num-workers", "0", "--ckpt-every", "2"]
    argv += list(flags)
    assert train_main(argv) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _close(a, b, keys=("loss", "grad_norm")):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]  # the same rows
    for ra, rb in zip(a, b, strict=True):
        for key in keys:
            assert abs(ra[key] - rb[key]) <= TOL * abs(rb[key]), (ra["step"], key, ra, rb)


def test_resume_on_another_topology_then_export(tmp_path, model_dir, capsys):
    saved = _train(tmp_path / "to_cp4", model_dir, "--dp", "2", "--cp", "2", "--steps", "2")
    shutil.copytree(tmp_path / "to_cp4", tmp_path / "to_cp2")
    for cp in (4, 2):
        uninterrupted = _train(
            tmp_path / f"cp{cp}", model_dir, "--cp", str(cp), "--grad-accum", "2", "--steps", "4"
        )
        _close(uninterrupted[:2], saved)
        capsys.readouterr()
        resumed = _train(
            tmp_path / f"to_cp{cp}", model_dir, "--cp", str(cp), "--steps", "4", "--resume"
        )
        _close(resumed[2:], uninterrupted[2:])
        assert all(r["rows"] > r["rows_text_only"] for r in resumed[2:])  # images in each step
        out = capsys.readouterr().out
        assert (
            f"cpvlm train: resharded: dp 2 x cp 2 -> dp 1 x cp {cp}; grad-accum 1 -> 2 keeps "
            "the global batch of 2 rows per step"
        ) in out, out

    run, hf = tmp_path / "to_cp4", tmp_path / "hf"
    assert export_main(["--run", str(run), "--out", str(hf)]) == 0
    copied = capsys.readouterr().out
    for name in PROCESSOR_FILES:
        assert name in copied, copied
        assert (hf / name).read_bytes() == (model_dir[0] / name).read_bytes()
    from transformers import AutoModelForImageTextToText

    exported = AutoModelForImageTextToText.from_pretrained(hf).state_dict()
    # The checkpoint read back by torch's own converter, independently of cpvlm.
    dcp_to_torch_save(run / "checkpoints" / "step_00000004", tmp_path / "trained.pt")
    trained = torch.load(tmp_path / "trained.pt", weights_only=False)["model"]
    assert {f"model.{k}" for k in exported} == set(trained)
    for k, v in exported.items():
        assert v.dtype == torch.float64 and torch.equal(v, trained[f"model.{k}"]), k
    assert export_main(["--run", str(run), "--out", str(hf)]) == 2
    assert "is not empty" in capsys.readouterr().err
