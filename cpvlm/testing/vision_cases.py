"""Vision cases shared by the balance tests and benchmarks/vision_dp.py: batches of items whose
units differ in size, and the vision towers of published checkpoints (``PUBLISHED_TOWERS``, from
the family kits' ``published_towers``).

Grids (t, h, w) in patch units (h, w multiples of the merge size 2), as in ``image_grid_thw``.
"""

from __future__ import annotations

# 12 images from 256 to 4096 patches and a 16-frame video of 1024-patch frames.
CURRENT_MIX = [
    (1, 16, 16), (1, 64, 64), (1, 24, 40), (1, 32, 32), (1, 48, 32), (1, 16, 32),
    (16, 32, 32),
    (1, 56, 56), (1, 24, 24), (1, 32, 64), (1, 40, 24), (1, 16, 16), (1, 48, 48),
]  # fmt: skip

# NeMo Automodel's case: 4 images of 1024 patches among 400 of 112 patches.
AUTOMODEL_MIX = [g for _ in range(4) for g in [(1, 32, 32), *[(1, 8, 14)] * 100]]

# A long video (50 frames of 1536 patches) and 300 small images of 64 to 256 patches.
_SMALL = [(1, 8, 8), (1, 8, 12), (1, 12, 16), (1, 16, 16)]
LONG_VIDEO_MIX = [(50, 32, 48), *[_SMALL[i % 4] for i in range(300)]]

MIXES = {"current": CURRENT_MIX, "automodel": AUTOMODEL_MIX, "long video": LONG_VIDEO_MIX}

# Units larger than a rank's share (vision="split"): three 1600-patch images among 23 small ones
# (at cp 8 one big image is 1.67x the mean cost of the default family's published tower), and one long high-resolution video
# (12 frames of 64 x 96 patches: at cp 8 whole frames give some ranks two, 1.33x the mean).
SPLIT_MIX = [*[(1, 40, 40)] * 3, *[_SMALL[i % 4] for i in range(23)]]
HIGH_RES_VIDEO = [(12, 64, 96)]
SPLIT_MIXES = {"3 x 1600 + small": SPLIT_MIX, "high-res video": HIGH_RES_VIDEO}


# Audio-heavy: long recordings (2 x 120 s, 6 x 30 s, 10 x 5 s; mel frames at 100 per second)
# beside the 12 images and the 16-frame video of CURRENT_MIX.
AUDIO_HEAVY_MIX = {"vision": CURRENT_MIX, "audio": [12000] * 2 + [3000] * 6 + [500] * 10}


def __getattr__(name: str):
    # PUBLISHED_TOWERS: from the family kits (importing them needs transformers, so lazily).
    if name == "PUBLISHED_TOWERS":
        from cpvlm.hf.registry import published_towers

        return published_towers()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
