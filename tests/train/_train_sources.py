"""Data sources for the trainer tests, used as ``--data _train_sources:<function>``.

pytest puts this directory on sys.path; subprocess tests pass it in PYTHONPATH.
"""

from cpvlm.integrations.hf import SampleSpec, synthetic_batch


def _sample(model_config, spec: SampleSpec, seed: int) -> dict:
    # Processor layout with the batch dim of 1 kept, labels and mm_token_type_ids included.
    return synthetic_batch(model_config, [spec], seed=seed)


def text_rows_on_dp0(model_config, seed):
    """Even samples (DP rank 0 of 2): 100 text tokens; odd ones (DP rank 1): one image each.

    With --seq-len 128 every row of DP rank 0 is text-only while DP rank 1's rows have images.
    """
    return [
        _sample(
            model_config,
            SampleSpec(text_len=100) if i % 2 == 0 else SampleSpec(images=((4, 4),), text_len=40),
            seed * 100 + i,
        )
        for i in range(16)
    ]


def broken_on_dp1(model_config, seed):
    """60-token text samples; sample 5 (the third of DP rank 1 of 2) holds an image token but no
    image, so DP rank 1 fails while building its second row (--seq-len 64)."""
    samples = [_sample(model_config, SampleSpec(text_len=60), seed * 100 + i) for i in range(12)]
    samples[5]["input_ids"][0, 10] = model_config.image_token_id
    return samples
