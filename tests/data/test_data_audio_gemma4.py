"""Audio clips on Gemma 4's data path (``gemma4-audio-tiny``'s checkpoint): feature frames from
``Gemma4AudioFeatureExtractor`` on each clip alone, the placeholders by the processor's own
``replace_audio_token``, ids and features equal to ``Gemma4Processor`` itself called on the
decoded samples (its PIL image processor; no video processor, which needs torchvision).
Decoding itself is tested with Qwen3-Omni's checkpoint (``test_data_audio.py``).
"""

import json

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoConfig, AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

from cpvlm.data import Record
from cpvlm.data.audio import AudioRef, load_audio
from cpvlm.data.errors import DataError
from cpvlm.families.gemma4 import clip_frames
from cpvlm.hf.data.processor import ChatEncoder
from cpvlm.hf.tiny_checkpoint import example_clip, make_tiny_checkpoint, write_images, write_wav

RATE = 16000


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("gemma4"), "gemma4", model="gemma4-audio-tiny"
    )
    return path, ChatEncoder(path, AutoConfig.from_pretrained(path))


def _messages(*items):
    return [
        {"role": "user", "content": [*items, {"type": "text", "text": "What is in the picture?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "two cats"}]},
    ]


def test_features_are_the_extractors_on_the_clip_alone(encoder):
    """A clip's frames are the extractor's on it alone, the frames whose 20 ms window is all
    samples (``(n - 161) // 160 + 1``); padding changes none of them, in a batch with a longer
    clip they are the same; past 30 s the extractor truncates, as the processor calls it."""
    _, enc = encoder
    fe = enc.media.feature_extractor
    rng = np.random.default_rng(0)
    short, long = (example_clip(rng, s, RATE, 1)[:, 0].astype(np.float32) for s in (0.3137, 1.2))
    mine = clip_frames(fe, short)
    assert mine.shape == ((len(short) - 161) // 160 + 1, enc.adapter.audio_feature_width)
    alone = fe([short], return_tensors="pt")  # the processor's keywords: the defaults
    assert torch.equal(mine, alone["input_features"][0][alone["input_features_mask"][0]])
    both = fe([long, short], return_tensors="pt")
    assert torch.equal(mine, both["input_features"][1][both["input_features_mask"][1]])
    assert len(clip_frames(fe, np.zeros(31 * RATE, np.float32))) == (30 * RATE - 161) // 160 + 1


def _reference(path):
    """``Gemma4Processor`` around the checkpoint's tokenizer, PIL image processor and feature
    extractor (its video processor needs torchvision: none)."""
    cls = transformers.Gemma4Processor
    lenient = type(cls.__name__, (cls,), {"check_argument_for_proper_class": lambda *a: None})
    return lenient(
        image_processor=AutoImageProcessor.from_pretrained(path),
        video_processor=None,
        feature_extractor=AutoFeatureExtractor.from_pretrained(path),
        tokenizer=AutoTokenizer.from_pretrained(path),
        chat_template=(path / "chat_template.jinja").read_text(),
        **{k: v for k, v in json.loads((path / "processor_config.json").read_text()).items()
           if k == "image_seq_length"},
    )  # fmt: skip


@pytest.mark.parametrize("seconds, rate, channels", [(1.37, 22050, 2), (0.52, 8000, 1)])
def test_ids_features_and_labels_equal_the_processor(encoder, tmp_path, seconds, rate, channels):
    path, enc = encoder
    write_images(tmp_path, [(40, 56)])
    write_wav(tmp_path / "a.wav", example_clip(np.random.default_rng(3), seconds, rate, channels),
              rate)  # fmt: skip
    messages = _messages(
        {"type": "audio", "audio": "a.wav"}, {"type": "image", "image": "img0.png"}
    )
    plan = enc.plan(Record(0, "t", {"messages": messages}, tmp_path))
    samples = load_audio(AudioRef(str(tmp_path / "a.wav")), RATE)
    reference = _reference(path)
    text = reference.apply_chat_template(messages, tokenize=False)
    out = reference(
        text=[text],
        images=[enc.media.image_processor.fetch_images(str(tmp_path / "img0.png"))],
        audio=[samples],
        return_tensors="pt",
    )
    assert torch.equal(plan.input_ids, out["input_ids"][0])
    core = enc.adapter.from_model_batch(dict(out))
    (item,) = plan.audios
    assert torch.equal(item.features, core["audio_features"])
    assert core["audio_lengths"].tolist() == [item.frames] == [(len(samples) - 161) // 160 + 1]
    config = enc.adapter.config
    pads = int((plan.input_ids == config.audio_token_id).sum())
    assert pads == enc.adapter.audio_rows(item.frames) > 0
    start = plan.input_ids.tolist().index(config.boa_token_id)
    assert plan.input_ids[start + pads + 1] == config.eoa_token_index
    special = torch.isin(plan.input_ids, torch.tensor(enc.adapter.special_token_ids))
    assert bool((plan.labels[special] == -100).all())
    assert enc.tokenizer.decode(plan.labels[plan.labels != -100]) == "two cats<end_of_turn>"


def test_rows_carry_every_clips_features(encoder, tmp_path):
    """The loader's row: all clips' frames one after another, in document order; the model's
    batch is the processor's layout (``input_features`` [clips, T, F] and its mask)."""
    from cpvlm.data.loader import RowJob, decode_row
    from cpvlm.data.rows import PackedPlan

    path, enc = encoder
    docs = []
    for i, seconds in enumerate((0.4, 1.6)):
        write_wav(tmp_path / f"a{i}.wav", example_clip(np.random.default_rng(i), seconds, RATE, 1),
                  RATE)  # fmt: skip
        messages = _messages({"type": "audio", "audio": f"a{i}.wav"})
        docs.append(enc.plan(Record(i, "t", {"messages": messages}, tmp_path)))
    batch = decode_row(RowJob(0, PackedPlan(docs), enc.ids, [], {}), enc.decode).batch()
    frames = [d.audios[0].frames for d in docs]
    assert batch["audio_lengths"].tolist() == frames == [39, 159]
    assert torch.equal(batch["audio_features"], torch.cat([d.audios[0].features for d in docs]))
    audio = batch["input_ids"] == enc.adapter.config.audio_token_id
    assert int(audio.sum()) == sum(enc.adapter.audio_rows(n) for n in frames)
    model = enc.adapter.to_model_batch(batch)
    assert model["input_features"].shape == (2, 159, enc.adapter.audio_feature_width)
    assert model["input_features_mask"].sum(1).tolist() == frames


def test_the_checkpoint_holds_the_feature_extractor(encoder, tmp_path):
    path, enc = encoder
    config = json.loads((path / "processor_config.json").read_text())
    extractor = config["feature_extractor"]
    assert extractor["feature_extractor_type"] == "Gemma4AudioFeatureExtractor"
    assert extractor["feature_size"] == enc.adapter.audio_feature_width == 16
    assert type(enc.media.feature_extractor).__name__ == "Gemma4AudioFeatureExtractor"
    assert type(enc.processor.feature_extractor).__name__ == "Gemma4AudioFeatureExtractor"


def test_gemma4_without_audio_reports_the_sample(tmp_path):
    """``gemma4-tiny`` (no audio tower): no feature extractor in its checkpoint, audio refused."""
    path = make_tiny_checkpoint(tmp_path / "g4", "gemma4")
    assert "feature_extractor" not in json.loads((path / "processor_config.json").read_text())
    enc = ChatEncoder(path, AutoConfig.from_pretrained(path))
    write_wav(tmp_path / "a.wav", np.zeros(RATE), RATE)
    with pytest.raises(DataError, match="bad_record: cpvlm takes no audio for gemma4"):
        messages = _messages({"type": "audio", "audio": "a.wav"})
        enc.plan(Record(0, "t", {"messages": messages}, tmp_path))
