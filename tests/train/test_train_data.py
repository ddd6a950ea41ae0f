"""Synthetic samples and row packing: deterministic, the promised mix, nothing lost, resumable."""

import pytest
import torch

from cpvlm.integrations.hf import SampleSpec, synthetic_batch, tiny_qwen2_5_vl_config
from cpvlm.integrations.hf import tiny_qwen3_vl_config as qwen3
from cpvlm.loss import shift_labels
from cpvlm.train.data import (
    IGNORE_INDEX,
    RowPacker,
    TokenIds,
    check_data_fits,
    normalize_sample,
    step_rows,
)
from cpvlm.train.synthetic import TEXT_BASE, TEXT_VOCAB, SyntheticVLMData

CONFIG = qwen3()
IDS = TokenIds.from_config(CONFIG)


def _is_text(ids):
    specials = [CONFIG.image_token_id, CONFIG.video_token_id]
    specials += [CONFIG.vision_start_token_id, CONFIG.vision_end_token_id]
    return ~torch.isin(ids, torch.tensor(specials))


def test_synthetic_samples_are_a_pure_function_of_seed_and_index():
    a, b = SyntheticVLMData(CONFIG, seed=3), SyntheticVLMData(CONFIG, seed=3)
    for i in (0, 7, 123):
        sa, sb = a[i], b[i]
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(SyntheticVLMData(CONFIG, seed=4)[0]["input_ids"], a[0]["input_ids"])


@pytest.mark.parametrize("make_config", [qwen3, tiny_qwen2_5_vl_config])
def test_synthetic_mix_images_4x_apart_videos_and_text_only(make_config):
    config = make_config()
    data = SyntheticVLMData(config, seed=0)
    sides, kinds, longest = [], set(), 0
    for i in range(200):
        s = data[i]
        normalize_sample(s, TokenIds.from_config(config), i)  # valid under the protocol
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


def _rows(packer, n):
    return [packer.next_row() for _ in range(n)]


def test_packing_loses_and_duplicates_nothing():
    data = SyntheticVLMData(CONFIG, seed=1)
    rows = _rows(RowPacker(data, 200, IDS), 12)
    stream = torch.cat([r.input_ids for r in rows])
    expected = torch.cat([data[i]["input_ids"] for i in range(200)])[: stream.numel()]
    assert torch.equal(stream, expected)
    for r in rows:
        assert r.num_tokens <= 200 and sum(r.doc_lens) == r.num_tokens
        n_images = int((r.input_ids == CONFIG.image_token_id).sum())
        grids = r.vision.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))
        assert n_images == int((grids.prod(-1) // 4).sum())
        # Labels: the ids, with the vision placeholders masked; per-document shift ends each doc.
        placeholders = torch.isin(r.input_ids, torch.tensor([IDS.image, IDS.video]))
        assert torch.equal(r.labels, r.input_ids.masked_fill(placeholders, IGNORE_INDEX))
        ends = torch.tensor(r.doc_lens).cumsum(0) - 1
        assert bool((shift_labels(r.labels, doc_lens=r.doc_lens)[ends] == IGNORE_INDEX).all())
    assert sum(len(r.doc_lens) for r in rows) > len(rows)  # several documents per row


def _same_rows(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert torch.equal(ra.input_ids, rb.input_ids) and ra.doc_lens == rb.doc_lens
        assert ra.vision.keys() == rb.vision.keys()
        assert all(torch.equal(ra.vision[k], rb.vision[k]) for k in ra.vision)


def test_packer_resumes_from_its_state():
    data = SyntheticVLMData(CONFIG, seed=2)
    a = RowPacker(data, 160, IDS)
    _rows(a, 4)
    b = RowPacker(data, 160, IDS, state=a.state_dict())
    _same_rows(_rows(a, 5), _rows(b, 5))


def test_the_global_order_is_the_same_for_every_dp_and_after_resuming_with_another():
    """Rows per step fixed at 4: dp 1, 2 and 4 train on the same rows each step (DP rank d on
    the d-th quarter, half, ...), and a stream saved at dp 2 continues identically at dp 4."""
    data = SyntheticVLMData(CONFIG, seed=3)
    one = RowPacker(data, 160, IDS)
    steps = [step_rows(one, 4, 0, 1) for _ in range(3)]
    for dp in (2, 4):
        packers = [RowPacker(data, 160, IDS) for _ in range(dp)]
        for step in steps:
            shares = [step_rows(p, 4, d, dp) for d, p in enumerate(packers)]
            assert all(len(s) == 4 // dp for s in shares)
            _same_rows([r for s in shares for r in s], step)
    saved = RowPacker(data, 160, IDS)
    step_rows(saved, 4, 1, 2)  # one step at dp 2, on DP rank 1
    resumed = [RowPacker(data, 160, IDS, state=saved.state_dict()) for _ in range(4)]
    for step in steps[1:]:
        _same_rows([r for d, p in enumerate(resumed) for r in step_rows(p, 4, d, 4)], step)
    with pytest.raises(ValueError, match="4 rows per step do not split over 3 DP ranks"):
        step_rows(saved, 4, 0, 3)


def test_user_samples_in_processor_layout_from_a_list():
    """A list of processor-style samples ([1, L] with labels and mm_token_type_ids) is cycled."""
    samples = [
        synthetic_batch(CONFIG, [SampleSpec(images=((2, 4),), text_len=20)], seed=0),
        synthetic_batch(CONFIG, [SampleSpec(text_len=30)], seed=1),
    ]
    assert [s["input_ids"].shape[1] for s in samples] == [24, 30]
    rows = _rows(RowPacker(samples, 40, IDS), 4)
    # Text-only samples split to fill a row (the rest is a new document in the next row); the
    # image sample moves whole to the next row when it does not fit.
    assert [r.doc_lens for r in rows] == [[24, 16], [14, 24, 2], [28], [24, 16]]
    assert [r.has_vision for r in rows] == [True, True, False, True]
    assert torch.equal(rows[2].input_ids, samples[1]["input_ids"][0, 2:])


def test_bad_samples_are_named():
    with pytest.raises(ValueError, match="sample 3: 1 image tokens"):
        ids = torch.tensor([20, 21, CONFIG.image_token_id, 22])
        normalize_sample({"input_ids": ids}, IDS, 3)
    with pytest.raises(ValueError, match="unknown keys"):
        normalize_sample({"input_ids": [1, 2], "pixels": 0}, IDS, 0)
    big = synthetic_batch(CONFIG, [SampleSpec(images=((8, 8),), text_len=60)], seed=0)
    with pytest.raises(ValueError, match="raise --seq-len to at least 78"):
        RowPacker([big], 64, IDS).next_row()

    def once():
        yield {"input_ids": torch.arange(20, 40)}

    packer = RowPacker(once(), 16, IDS)
    packer.next_row()
    with pytest.raises(ValueError, match="one-shot generator"):
        _rows(packer, 2)


def test_seq_len_too_short_for_the_synthetic_images():
    data = SyntheticVLMData(CONFIG, seed=0)
    with pytest.raises(ValueError, match=f"--seq-len {data.max_sample_len()} or more"):
        check_data_fits(data, 64)
    check_data_fits(data, data.max_sample_len())
