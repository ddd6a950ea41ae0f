"""Synthetic samples and tokenized samples through the row stream: the promised mix, nothing lost."""

import pytest
import torch

from cpvlm.constants import IGNORE_INDEX
from cpvlm.data import DataError, LazyPixels, RowStream, TokenIds, plan_tokenized
from cpvlm.data.sources import ObjectSource
from cpvlm.hf import TINY_MODELS, SampleSpec, synthetic_batch
from cpvlm.loss import shift_labels
from cpvlm.train.data import check_data_fits
from cpvlm.train.synthetic import TEXT_BASE, TEXT_VOCAB, SyntheticVLMData

CONFIG = TINY_MODELS["qwen3-vl-tiny"]()
IDS = TokenIds.from_config(CONFIG)


def _is_text(ids):
    specials = [CONFIG.image_token_id, CONFIG.video_token_id]
    specials += [CONFIG.vision_start_token_id, CONFIG.vision_end_token_id]
    return ~torch.isin(ids, torch.tensor(specials))


def _tensor(value):
    return value.rows() if isinstance(value, LazyPixels) else value


def test_synthetic_samples_are_a_pure_function_of_seed_and_index():
    a, b = SyntheticVLMData(CONFIG, seed=3), SyntheticVLMData(CONFIG, seed=3)
    for i in (0, 7, 123):
        sa, sb = a[i], b[i]
        assert sa.keys() == sb.keys()
        assert all(torch.equal(_tensor(sa[k]), _tensor(sb[k])) for k in sa)
    assert not torch.equal(SyntheticVLMData(CONFIG, seed=4)[0]["input_ids"], a[0]["input_ids"])


@pytest.mark.parametrize("name", ["qwen3-vl-tiny", "qwen2.5-vl-tiny"])
def test_synthetic_mix_images_4x_apart_videos_and_text_only(name):
    config = TINY_MODELS[name]()
    data = SyntheticVLMData(config, seed=0)
    sides, kinds, longest = [], set(), 0
    for i in range(200):
        s = data[i]
        plan_tokenized(
            s, TokenIds.from_config(config), i, f"sample {i}"
        )  # valid under the protocol
        longest = max(longest, s["input_ids"].numel())
        if "image_grid_thw" in s:
            kinds.add("image")
            sides += s["image_grid_thw"][:, 1:].flatten().tolist()
        if "video_grid_thw" in s:
            kinds.add("video")
            assert ("second_per_grid_ts" in s) == (config.model_type == "qwen2_5_vl")
        if "image_grid_thw" not in s and "video_grid_thw" not in s:
            kinds.add("text")
    assert kinds == {"image", "video", "text"}
    assert max(sides) >= 4 * min(sides)
    assert longest <= data.max_sample_len()


def test_synthetic_text_counts_through_a_small_vocabulary():
    """The learnable part: text ids step by a per-document stride, across the images."""
    data = SyntheticVLMData(CONFIG, seed=0)
    for i in range(20):
        ids = data[i]["input_ids"]
        text = ids[_is_text(ids)] - TEXT_BASE
        assert bool(((text >= 0) & (text < TEXT_VOCAB)).all())
        steps = (text[1:] - text[:-1]) % TEXT_VOCAB
        assert steps.unique().numel() == 1 and int(steps[0]) in (1, 2, 3)


def _rows(source, seq_len, n, window=64):
    stream = RowStream(source, lambda r: plan_tokenized(r.data, IDS, r.index, r.where),
                       seq_len=seq_len, window=window, shuffle=False)  # fmt: skip
    rows = stream.rows()
    return [next(rows).row for _ in range(n)]


def test_packing_loses_and_duplicates_nothing():
    data = SyntheticVLMData(CONFIG, seed=1)
    rows = _rows(ObjectSource(data, "synthetic"), 200, 12, window=32)
    docs = sorted(d.index for r in rows for d in r.docs)
    assert docs == sorted(set(docs)) and set(range(32)) <= set(docs)  # whole windows, once each
    for r in rows:
        assert r.num_tokens <= 200 and sum(r.doc_lens) == r.num_tokens
        for d in r.docs:
            assert torch.equal(d.input_ids, data[d.index]["input_ids"])  # whole, never cut
        n_images = int((r.input_ids == CONFIG.image_token_id).sum())
        assert n_images == int((r.grid_thw()[: len(r.images)].prod(-1) // 4).sum())
        # Labels: the ids, with the vision placeholders masked; per-document shift ends each doc.
        placeholders = torch.isin(r.input_ids, torch.tensor([IDS.image, IDS.video]))
        assert torch.equal(r.labels, r.input_ids.masked_fill(placeholders, IGNORE_INDEX))
        ends = torch.tensor(r.doc_lens).cumsum(0) - 1
        assert bool((shift_labels(r.labels, doc_lens=r.doc_lens)[ends] == IGNORE_INDEX).all())
    assert sum(len(r.doc_lens) for r in rows) > len(rows)  # several documents per row
    assert sum(r.num_tokens for r in rows[:-1]) / (200 * (len(rows) - 1)) > 0.9  # nearly full


def test_user_samples_in_processor_layout_from_a_list():
    """A list of processor-style samples ([1, L] with labels and mm_token_type_ids) is cycled;
    a text-only sample longer than a row is cut to the row."""
    samples = [
        synthetic_batch(CONFIG, [SampleSpec(images=((2, 4),), text_len=20)], seed=0),
        synthetic_batch(CONFIG, [SampleSpec(text_len=30)], seed=1),
        synthetic_batch(CONFIG, [SampleSpec(text_len=50)], seed=2),
    ]
    assert [s["input_ids"].shape[1] for s in samples] == [24, 30, 50]
    rows = _rows(ObjectSource(samples, "samples"), 40, 4, window=3)
    assert [[d.index for d in r.docs] for r in rows] == [[0], [1], [2], [0]]
    assert [r.doc_lens for r in rows] == [[24], [30], [40], [24]]
    assert rows[2].docs[0].truncated and torch.equal(
        rows[2].input_ids, samples[2]["input_ids"][0, :40]
    )
    assert [bool(r.images) for r in rows] == [True, False, False, True]


def test_bad_samples_are_named():
    with pytest.raises(DataError, match="1 image tokens") as err:
        ids = torch.tensor([20, 21, CONFIG.image_token_id, 22])
        plan_tokenized({"input_ids": ids}, IDS, 3, "sample 3")
    assert err.value.reason == "vision_token_mismatch"
    with pytest.raises(DataError, match="unknown keys"):
        plan_tokenized({"input_ids": [1, 2], "pixels": 0}, IDS, 0, "sample 0")
    big = synthetic_batch(CONFIG, [SampleSpec(images=((8, 8),), text_len=60)], seed=0)
    stream = RowStream(ObjectSource([big, {"input_ids": torch.arange(20, 40)}], "x"),
                       lambda r: plan_tokenized(r.data, IDS, r.index, r.where), seq_len=64,
                       window=2, shuffle=False)  # fmt: skip
    first = next(stream.rows())
    assert [(e.where, e.reason) for e in first.errors] == [("x sample 0", "too_long")]

    def once():
        yield {"input_ids": torch.arange(20, 40)}

    assert len(ObjectSource(once(), "generator")) == 1  # read once into a list, then cycled


def test_seq_len_too_short_for_the_synthetic_images():
    data = SyntheticVLMData(CONFIG, seed=0)
    with pytest.raises(ValueError, match=f"--seq-len {data.max_sample_len()} or more"):
        check_data_fits(data, 64)
    check_data_fits(data, data.max_sample_len())


def test_synthetic_pixels_are_lazy_and_any_range_gives_the_same_rows():
    """Pixels are made only where a rank encodes them: a sub-range, a frame alone, or a unit
    decoded by the loader equals the same rows of the whole tensor."""
    from cpvlm.data.loader import _item_rows
    from cpvlm.train.synthetic import PIXEL_BLOCK, RandomRows

    make = RandomRows(seed=11, width=6)
    whole = make(0, 5 * PIXEL_BLOCK)
    for start, stop in ((0, 1), (3, PIXEL_BLOCK + 5), (PIXEL_BLOCK, 2 * PIXEL_BLOCK), (130, 317)):
        assert torch.equal(make(start, stop), whole[start:stop])
    assert not torch.equal(RandomRows(seed=12, width=6)(0, 8), whole[:8])
    data = SyntheticVLMData(CONFIG, seed=0)
    videos = 0
    for i in range(40):
        raw = data[i]
        plan = plan_tokenized(raw, IDS, i, f"sample {i}")
        for key, items in (("pixel_values", plan.images), ("pixel_values_videos", plan.videos)):
            if not items:
                continue
            full, start = raw[key].rows(), 0
            for item in items:
                n = item.grid[0] * item.patches_per_frame
                assert isinstance(item.pixels, LazyPixels)
                assert torch.equal(_item_rows(None, item, None), full[start : start + n])
                if item.grid[0] > 1:  # one temporal patch of a video, alone
                    videos += 1
                    f = item.patches_per_frame
                    one = _item_rows(None, item, [1])
                    assert torch.equal(one, full[start + f : start + 2 * f])
                start += n
    assert videos > 0
