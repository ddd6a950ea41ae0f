"""``cpvlm train --model DIR --data DIR/data/train.jsonl`` on the example data of LLaVA-OneVision,
InternVL, Gemma 4 (with and without audio), Qwen3-Omni and Nemotron Omni
(``examples/make_example_data.py --model <model>``): conversations with images of several sizes
(anyres crops, tiles, patch budgets), multi-image samples and videos of frames (LLaVA-OneVision:
pooled frames and a newline row; InternVL: one-tile frames; Gemma 4: timestamped frames), and for
Qwen3-Omni, ``gemma4-audio-tiny`` and Nemotron Omni WAV clips (0.5 to 2.5 s, at 8 to 22 kHz, mono
and stereo: shorter and longer than Qwen3-Omni's 100-frame chunk; 13 to 63 rows of Gemma 4's
tower, across its chunks of 4; Nemotron Omni: no videos, images on patch budgets), through each
family's own processor (and feature extractor). With one pass of the 12 samples over the two
steps, every sample is trained, the six audio clips among them. CP=2 must equal CP=1 step for step
in float64 to 1e-10 relative (the CP run sums the same terms in another order, ~1e-16 per
operation over two steps).
"""

import json
import runpy
import sys
from pathlib import Path

import pytest

from cpvlm.train.command import main as train_main

ROOT = Path(__file__).resolve().parents[2]
MODELS = [
    "llava-onevision-tiny",
    "internvl-tiny",
    "gemma4-tiny",
    "gemma4-audio-tiny",
    "qwen3-omni-moe-tiny",
    "nemotron-omni-tiny",
]
AUDIO_MODELS = {"qwen3-omni-moe-tiny", "gemma4-audio-tiny", "nemotron-omni-tiny"}
VIDEO_MODELS = set(MODELS) - {"nemotron-omni-tiny"}
# One pass of the 12 samples per pack window: rows are packed longest first, so the two steps'
# rows hold the longest samples of one pass, the videos among them (with the default window of
# 64 the first rows took the longest images of five passes, and no video).
FLAGS = ["--dtype", "float64", "--steps", "2", "--pack-window", "12"]
# gemma4-audio-tiny's 12 samples are 1925 tokens (Gemma 4's longer images and its audio rows):
# two rows of 1024 hold one pass, two of the default 512 only half of it.
MODEL_FLAGS = {"gemma4-audio-tiny": ["--seq-len", "1024"]}


@pytest.fixture(scope="module")
def example_dirs(tmp_path_factory, monkeypatch_module):
    """One example folder per family, written by the example script itself."""
    root = tmp_path_factory.mktemp("examples")
    dirs = {}
    for model in MODELS:
        out = root / model
        argv = ["make_example_data.py", str(out), "--model", model, "--samples", "12"]
        monkeypatch_module.setattr(sys, "argv", argv)
        runpy.run_path(str(ROOT / "examples" / "make_example_data.py"), run_name="__main__")
        lines = (out / "data" / "train.jsonl").read_text()
        assert ('"type": "video"' in lines) == (model in VIDEO_MODELS), model
        assert ('"type": "audio"' in lines) == (model in AUDIO_MODELS), model
        dirs[model] = out
    return dirs


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _sample_tokens(folder: Path) -> int:
    """The tokens of every sample of the example data, planned by the data path."""
    from transformers import AutoConfig

    from cpvlm.data import Record
    from cpvlm.hf.data.processor import ChatEncoder

    encoder = ChatEncoder(folder / "ckpt", AutoConfig.from_pretrained(folder / "ckpt"))
    lines = (folder / "data" / "train.jsonl").read_text().splitlines()
    plans = [
        encoder.plan(Record(i, "x", json.loads(line), folder / "data"))
        for i, line in enumerate(lines)
    ]
    assert sum(len(p.audios) for p in plans) == 6
    return sum(len(p) for p in plans)


def _train(out: Path, *flags) -> list[dict]:
    assert train_main(["--out", str(out), *FLAGS, *flags]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("model", MODELS)
def test_cp2_equals_cp1_on_the_example_data(example_dirs, model):
    folder = example_dirs[model]
    data = ["--model", str(folder / "ckpt"), "--data", str(folder / "data" / "train.jsonl")]
    data += MODEL_FLAGS.get(model, [])
    one = _train(folder / "cp1", *data, "--cp", "1", "--num-workers", "0")
    two = _train(folder / "cp2", *data, "--cp", "2")
    assert [r["tokens"] for r in one] == [r["tokens"] for r in two]  # the same rows
    if model in AUDIO_MODELS:  # one pass over the samples: each of them in the two steps
        assert sum(r["tokens"] for r in one) == _sample_tokens(folder)
    for a, b in zip(one, two, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-10 * abs(a["loss"]), (a["step"], a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-10 * abs(a["grad_norm"])
    assert all(r["bad_samples"] == 0 and r["rows_replaced"] == 0 for r in two)
    assert all(r["rows"] > r["rows_text_only"] for r in two)  # images in every step
