"""Pixel rows of a piece of an image or video frame (``vision="split"``), equal to the whole
frame's rows at those groups, bit for bit.

Legend: p patch size, m merge size, tp temporal patch size, wg a frame's width in merge groups.

A resize reads neighbouring pixels, so the whole frame is decoded and resized as the processor
does it; the steps after it (rescale and normalise, per pixel; patchify, a permutation) then run
on the band of merged rows that holds the piece (``cpvlm.vision.pieces.group_band``) and the
piece's rows are taken from the band's. For a Qwen-VL image processor on the PIL backend the
band goes through the processor's own ``_preprocess`` with the resize done; for a video, through
the pipeline of ``VideoSettings.pixels``. Any other image processor makes the whole frame's rows
and keeps the piece's (``None`` here: the caller falls back).
"""

from __future__ import annotations

import torch

from cpvlm.families.qwen_vl_processing import IMAGE_RULES, VideoSettings, base_class_name
from cpvlm.vision.pieces import Groups, band_rows, group_band


def image_piece_rows(
    image_processor, image, grid: tuple[int, int, int], groups: Groups
) -> torch.Tensor | None:
    """Pixel rows of merge groups ``groups`` of a PIL ``image`` as ``image_processor`` would make
    them for the whole image; None where this processor has no band path, or its resize gives
    another grid than ``grid`` (the whole-image path then reports it)."""
    try:
        from transformers.image_processing_backends import PilBackend
    except ImportError:
        return None
    ip = image_processor
    if not isinstance(ip, PilBackend) or base_class_name(type(ip).__name__) not in IMAGE_RULES:
        return None
    # transformers' own preprocess: the call's options from the processor, then its inputs
    kwargs = {n: getattr(ip, n, None) for n in ip._valid_kwargs_names}
    kwargs = ip._standardize_kwargs(**kwargs)
    (x,) = ip._prepare_image_like_inputs([image], **kwargs)
    side = kwargs["patch_size"] * kwargs["merge_size"]
    if kwargs["do_resize"]:  # as Qwen2VLImageProcessorPil._preprocess resizes
        x = ip.resize(x, size=kwargs["size"], resample=kwargs["resample"], factor=side)
    p = kwargs["patch_size"]
    if tuple(x.shape[-2:]) != (grid[1] * p, grid[2] * p):
        return None
    wg = x.shape[-1] // side
    first, stop = group_band(groups, wg)
    band = x[..., first * side : stop * side, :]
    out = ip._preprocess([band], **{**kwargs, "do_resize": False, "return_tensors": "pt"})
    return out["pixel_values"][band_rows(groups, wg, kwargs["merge_size"])]


def video_piece_rows(
    video: VideoSettings, frames_THWC: torch.Tensor, grid_hw: tuple[int, int], groups: Groups
) -> torch.Tensor:
    """Pixel rows of merge groups ``groups`` of tp frames, as ``video.pixels`` makes them for
    the whole frames."""
    p, m = video.patch_size, video.merge_size
    x = video.resized(frames_THWC, grid_hw)
    wg = grid_hw[1] // m
    first, stop = group_band(groups, wg)
    rows = video.rows(x[..., first * m * p : stop * m * p, :])
    return rows[band_rows(groups, wg, m)]
