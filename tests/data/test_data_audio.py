"""Audio clips on the data path (Qwen3-Omni's tiny checkpoint): decoding with PyAV, feature frames
from the checkpoint's own feature extractor on each clip alone, and the placeholders.

Decoding is checked against the samples written: a 16-bit WAV decodes to them / 32768 exactly
(the resampler at the file's rate converts s16 to float, a scaling by a power of two), a FLAC of
the same samples to the same floats (lossless), a stereo file to the mean of its channels. A
resampled clip has the rate's length (to the resampler's few-sample edge) and the tone it had.
Features and ids are compared with ``Qwen3OmniMoeProcessor`` itself called on the decoded
samples of one clip (its PIL image processor; no video processor, which needs torchvision).
"""

import json

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, WhisperFeatureExtractor

from cpvlm.data import Record
from cpvlm.data.audio import AudioRef, audio_ref, load_audio
from cpvlm.data.errors import DataError
from cpvlm.hf.chat_media import clip_features
from cpvlm.hf.data.processor import ChatEncoder
from cpvlm.hf.tiny_checkpoint import example_clip, make_tiny_checkpoint, write_images, write_wav

RATE = 16000


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("omni"), "qwen3_omni_moe")
    return path, ChatEncoder(path, AutoConfig.from_pretrained(path))


def _pcm(x):
    return np.round(np.clip(x, -1, 1) * 32767).astype(np.int16)


def _flac(path, pcm_NC, rate):
    import av

    layout = "mono" if pcm_NC.shape[1] == 1 else "stereo"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("flac", rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(pcm_NC.reshape(1, -1), format="s16", layout=layout)
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    return path


@pytest.mark.parametrize("channels", [1, 2])
def test_wav_and_flac_decode_to_the_mean_of_the_channels(tmp_path, channels):
    clip = example_clip(np.random.default_rng(channels), 0.7, RATE, channels)
    pcm = _pcm(clip)
    mono = pcm.astype(np.float64).mean(1) / 32768  # stereo: the mean, not a 1/sqrt(2) downmix
    wav = load_audio(AudioRef(str(write_wav(tmp_path / "a.wav", clip, RATE))), RATE)
    flac = load_audio(AudioRef(str(_flac(tmp_path / "a.flac", pcm, RATE))), RATE)
    assert wav.dtype == np.float32 and wav.shape == (len(pcm),)
    # float32 of the mean: one rounding of the float32 channel sum
    np.testing.assert_allclose(wav, mono, rtol=0, atol=2**-24)
    np.testing.assert_array_equal(flac, wav)
    data = (tmp_path / "a.wav").read_bytes()  # a record's {"bytes": ...}
    np.testing.assert_array_equal(load_audio(audio_ref({"bytes": data}, None), RATE), wav)


@pytest.mark.parametrize("rate", [8000, 22050, 44100])
def test_a_clip_is_resampled_to_the_extractors_rate(tmp_path, rate):
    seconds, pitch = 1.0, 440.0
    t = np.arange(int(seconds * rate)) / rate
    write_wav(tmp_path / "a.wav", 0.5 * np.sin(2 * np.pi * pitch * t), rate)
    out = load_audio(AudioRef(str(tmp_path / "a.wav")), RATE)
    assert abs(len(out) - seconds * RATE) <= 32  # the resampler's edge
    spectrum = np.abs(np.fft.rfft(out[: RATE // 2]))
    assert abs(np.argmax(spectrum) * 2 - pitch) <= 2  # bins of 2 Hz over half a second
    assert 0.45 < np.abs(out[1000:-1000]).max() < 0.55


def test_missing_and_unreadable_audio_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="missing_media"):
        load_audio(AudioRef(str(tmp_path / "none.wav")), RATE)
    (tmp_path / "bad.wav").write_bytes(b"not audio at all")
    with pytest.raises(DataError, match="unreadable_media"):
        load_audio(AudioRef(str(tmp_path / "bad.wav")), RATE)


def test_features_are_the_extractors_on_the_clip_alone():
    """A clip's frames are the extractor's on it alone: in a batch with a longer clip its last
    frame and its frame count differ (why the data path extracts clip by clip)."""
    fe = WhisperFeatureExtractor(feature_size=16)
    rng = np.random.default_rng(0)
    short, long = (example_clip(rng, s, RATE, 1)[:, 0].astype(np.float32) for s in (0.3137, 1.2))
    mine = clip_features(fe, short)
    # the processor's audio keywords (Qwen3OmniMoeProcessor.audio_kwargs), one clip
    kwargs = {"padding": True, "truncation": False, "return_attention_mask": True}
    alone = fe(short, sampling_rate=RATE, return_tensors="pt", **kwargs)
    assert mine.shape == (len(short) // fe.hop_length, 16)
    assert bool(alone["attention_mask"].all())
    assert torch.equal(mine, alone["input_features"][0].T)
    both = fe([short, long], sampling_rate=RATE, return_tensors="pt", **kwargs)
    batched = both["input_features"][0].T[both["attention_mask"][0].bool()]
    assert len(batched) != len(mine) or not torch.equal(batched, mine)


def _reference(path):
    """``Qwen3OmniMoeProcessor`` around the checkpoint's tokenizer, PIL image processor and
    feature extractor (its video processor needs torchvision: none)."""
    cls = transformers.Qwen3OmniMoeProcessor
    lenient = type(cls.__name__, (cls,), {"check_argument_for_proper_class": lambda *a: None})
    return lenient(
        image_processor=AutoImageProcessor.from_pretrained(path),
        video_processor=None,
        feature_extractor=transformers.AutoFeatureExtractor.from_pretrained(path),
        tokenizer=AutoTokenizer.from_pretrained(path),
        chat_template=(path / "chat_template.jinja").read_text(),
    )


def test_ids_features_and_labels_equal_the_processor(encoder, tmp_path):
    path, enc = encoder
    write_images(tmp_path, [(40, 56)])
    clip = example_clip(np.random.default_rng(3), 1.37, 22050, 2)
    write_wav(tmp_path / "a.wav", clip, 22050)
    messages = [
        {"role": "user", "content": [{"type": "audio", "audio": "a.wav"},
                                     {"type": "image", "image": "img0.png"},
                                     {"type": "text", "text": "What is in the picture?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "two cats"}]},
    ]  # fmt: skip
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
    assert core["audio_lengths"].tolist() == [item.frames] == [len(samples) // 160]
    config = enc.adapter.config
    pads = int((plan.input_ids == config.audio_token_id).sum())
    assert pads == enc.adapter.audio_rows(item.frames) > 0  # the ids equal the processor's
    start = plan.input_ids.tolist().index(config.audio_start_token_id)
    assert plan.input_ids[start + pads + 1] == config.audio_end_token_id
    audio = torch.isin(plan.input_ids, torch.tensor(enc.adapter.audio_token_ids))
    assert bool((plan.labels[audio] == -100).all())
    assert enc.tokenizer.decode(plan.labels[plan.labels != -100]) == "two cats<|im_end|>"


def test_rows_carry_every_clips_features(encoder, tmp_path):
    """The loader's row: all clips' frames one after another, in document order, on every rank."""
    from cpvlm.data.loader import RowJob, decode_row
    from cpvlm.data.rows import PackedPlan

    path, enc = encoder
    docs = []
    for i, seconds in enumerate((0.4, 1.6)):
        write_wav(tmp_path / f"a{i}.wav", example_clip(np.random.default_rng(i), seconds, RATE, 1),
                  RATE)  # fmt: skip
        messages = [
            {"role": "user", "content": [{"type": "audio", "audio": f"a{i}.wav"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "yes"}]},
        ]
        docs.append(enc.plan(Record(i, "t", {"messages": messages}, tmp_path)))
    row = decode_row(RowJob(0, PackedPlan(docs), enc.ids, [], {}), enc.decode)
    batch = row.batch()
    assert batch["audio_lengths"].tolist() == [d.audios[0].frames for d in docs] == [40, 160]
    assert torch.equal(batch["audio_features"], torch.cat([d.audios[0].features for d in docs]))
    assert int((batch["mm_token_type_ids"] == 3).sum()) == sum(
        enc.adapter.audio_rows(n) for n in (40, 160)
    )


def test_the_checkpoint_holds_the_feature_extractor(encoder):
    path, enc = encoder
    config = json.loads((path / "processor_config.json").read_text())
    assert config["feature_extractor"]["feature_extractor_type"] == "WhisperFeatureExtractor"
    assert config["feature_extractor"]["feature_size"] == enc.adapter.audio_feature_width
    assert type(enc.media.feature_extractor).__name__ == "WhisperFeatureExtractor"


def test_the_legacy_layout_plans_the_same(encoder, tmp_path):
    """The older layout (the feature extractor's entries beside the image processor's in
    ``preprocessor_config.json``, as published omni checkpoints have them) plans alike."""
    path, enc = encoder
    legacy = make_tiny_checkpoint(tmp_path / "legacy", "qwen3_omni_moe", layout="legacy")
    other = ChatEncoder(legacy, AutoConfig.from_pretrained(legacy))
    write_wav(tmp_path / "a.wav", example_clip(np.random.default_rng(5), 0.9, 8000, 1), 8000)
    messages = [
        {"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "yes"}]},
    ]
    a, b = (e.plan(Record(0, "t", {"messages": messages}, tmp_path)) for e in (enc, other))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert torch.equal(a.audios[0].features, b.audios[0].features)


def test_an_item_without_a_path_takes_the_records_audios(encoder, tmp_path):
    """As images from ``images``: an audio item without a value takes the next entry of the
    record's ``audios`` list (here encoded bytes), and plans as the file does."""
    path, enc = encoder
    write_wav(tmp_path / "a.wav", example_clip(np.random.default_rng(7), 0.8, RATE, 1), RATE)
    answer = {"role": "assistant", "content": [{"type": "text", "text": "yes"}]}

    def plan(item, **extra):
        messages = [{"role": "user", "content": [item, {"type": "text", "text": "Hm?"}]}, answer]
        return enc.plan(Record(0, "t", {"messages": messages, **extra}, tmp_path))

    a = plan({"type": "audio", "audio": "a.wav"})
    b = plan({"type": "audio"}, audios=[{"bytes": (tmp_path / "a.wav").read_bytes()}])
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.audios[0].features, b.audios[0].features)
    with pytest.raises(DataError, match="bad_record"):
        plan({"type": "audio"})  # nothing to take


def test_a_family_without_audio_reports_the_sample(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "vl", "qwen3_vl")
    enc = ChatEncoder(path, AutoConfig.from_pretrained(path))
    write_wav(tmp_path / "a.wav", np.zeros(RATE), RATE)
    messages = [
        {"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "yes"}]},
    ]
    with pytest.raises(DataError, match="bad_record: cpvlm takes no audio for qwen3_vl"):
        enc.plan(Record(0, "t", {"messages": messages}, tmp_path))
