"""vision="split": the pixel rows each CP rank makes for a sharded image, whole units (before)
against its pieces' groups only (after), and the time of the Qwen-VL image processor for both.

    python benchmarks/split_decode.py     # under a minute

One image of 1080 x 1920 pixels (Qwen2-VL's image processor, patch 16, merge 2: a 68 x 120
patch grid) beside 8 small ones of 16 x 16 patches, split over cp ranks as ``split_assignment``
cuts them (patch costs). Rows: max and mean over ranks of the pixel rows a rank makes (before:
every unit it reads, whole; after: ``pixel_rows_read``). Seconds: the busiest rank's processor
time for the large image, the whole image (before) against ``image_piece_rows`` of its piece
(after; the decode and the resize still cover the whole image), best of --repeats.
"""

from __future__ import annotations

import io
import time

from _common import parser, print_table, write_json


def main():
    import numpy as np
    import torch
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from cpvlm.encoders import split_assignment, vision_units
    from cpvlm.encoders.pieces import piece_groups, pixel_rows_read
    from cpvlm.encoders.split import pixel_order
    from cpvlm.families.qwen2_vl import image_piece_rows

    p = parser(__doc__)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    ip = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=256 * 256,
        max_pixels=16384 * 32 * 32,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    pixels = (rng.random((1080, 1920, 3)) * 40 + np.linspace(0, 200, 1920)[None, :, None]).astype(
        np.uint8
    )
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG")
    data = buf.getvalue()

    def load():
        return Image.open(io.BytesIO(data)).convert("RGB")

    grid = tuple(int(v) for v in ip(images=[load()], return_tensors="pt")["image_grid_thw"][0])
    grids = torch.tensor([grid] + [(1, 16, 16)] * 8)
    units = vision_units(grids, 2)

    def best(f):
        out = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            f()
            out = min(out, time.perf_counter() - start)
        return out

    whole_s = best(lambda: ip(images=[load()], return_tensors="pt"))
    results = []
    for cp in args.cp:
        sa = split_assignment(units.pixel_counts, units.row_counts, cp)
        orders = [pixel_order(n) for n in units.row_counts]
        before = [sum(units.pixel_counts[u] for u in sa.units_of(r)) for r in range(cp)]
        groups = [piece_groups(orders, sa, r) for r in range(cp)]
        after = [len(pixel_rows_read(units, sa.units_of(r), groups[r])) for r in range(cp)]
        largest = max((g[0] for g in groups if 0 in g), key=len)
        piece_s = best(lambda g=largest: image_piece_rows(ip, load(), grid, g))
        results.append(
            {
                "cp": cp, "rows_before_max": max(before), "rows_after_max": max(after),
                "rows_before_mean": sum(before) / cp, "rows_after_mean": sum(after) / cp,
                "large_image_s_before": whole_s, "large_image_s_after": piece_s,
                "s_after/before": piece_s / whole_s,
            }
        )  # fmt: skip
    cols = list(results[0])
    print_table(results, cols, f"pixel rows per rank and image-processor seconds, grid {grid}")
    write_json(args.out_dir, "split_decode", {"grid": grid, "results": results})


if __name__ == "__main__":
    main()
