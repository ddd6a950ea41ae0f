"""The batches of a check, for any family: a mixed padded batch and a packed row of documents.

Sides are in patches, multiples of ``s = 2 * max(m, 2)`` for the spatial merge size m (two merged
tokens, at least 4 patches), so that every family takes the same shapes.
"""

from __future__ import annotations

import torch

# cpvlm.hf (and transformers) is imported where a batch is made, not with this module.


def _side(adapter) -> int:
    return 2 * max(adapter.merge_size, 2)


def mixed_batch(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Images of two sizes (and a video where the model's own forward takes images and videos in
    one call; GLM-4V's does not; and the kit's first audio clip where the model has an audio
    encoder) in one row, a text-only row; right padding."""
    from cpvlm.hf import SampleSpec, adapter_for, kit_for, synthetic_batch

    adapter = adapter_for(model.config)
    s = _side(adapter)
    kit = kit_for(model.config)
    mixes = kit.mixes_images_and_videos and adapter.takes_videos
    clips = kit.audio_clips[:1] if adapter.audio_token_id is not None else ()
    samples = [
        SampleSpec(
            images=((s, s), (2 * s, s)),
            videos=((2, s, s),) if mixes else (),
            text_len=21,
            audios=clips,
        ),
        SampleSpec(text_len=30),
    ]
    return synthetic_batch(model.config, samples, dtype=dtype, seed=1)


def packed_documents(model, dtype: torch.dtype):
    """Documents packed in one row: an image and a video (for GLM-4V an image document, then a
    video document; without videos (Gemma 3) a second image), a 3-token text document, two
    images, and where the model has an audio encoder a document of the kit's audio clips. Returns ``(packed batch, the single-document batches, doc_lens)``."""
    from cpvlm.hf import (
        SampleSpec,
        adapter_for,
        kit_for,
        pack_documents,
        synthetic_batch,
    )

    adapter = adapter_for(model.config)
    s = _side(adapter)
    if not adapter.takes_videos:
        docs = [SampleSpec(images=((s, 2 * s), (s, s)), text_len=9)]
    elif kit_for(model.config).mixes_images_and_videos:
        docs = [SampleSpec(images=((s, 2 * s),), videos=((2, s, s),), text_len=9)]
    else:
        docs = [
            SampleSpec(images=((s, 2 * s),), text_len=5),
            SampleSpec(videos=((2, s, s),), text_len=4),
        ]
    docs += [SampleSpec(text_len=3), SampleSpec(images=((s, s), (s, s)), text_len=12)]
    if adapter.audio_token_id is not None:
        docs.append(SampleSpec(audios=kit_for(model.config).audio_clips, text_len=5))
    parts = [
        synthetic_batch(model.config, [d], dtype=dtype, seed=10 + i) for i, d in enumerate(docs)
    ]
    for p in parts:
        p.pop("attention_mask")
    return pack_documents(parts), parts, [p["input_ids"].shape[1] for p in parts]


def verify_batches(model, dtype: torch.dtype) -> dict[str, tuple[dict, list | None]]:
    """``{name: (batch, doc_lens)}`` of ``mixed_batch`` and ``packed_documents``."""
    packed, _, doc_lens = packed_documents(model, dtype)
    return {"mixed": (mixed_batch(model, dtype), None), "packed": (packed, doc_lens)}
