"""Images and video frames: where they are, their size from the file header, and decoding.

Sizes come from the header alone (PIL reads it without decoding the pixels), with the EXIF
orientation applied, so that every rank can compute the grids and token counts of every image
while only the rank that encodes an image decodes it. Decoding gives what transformers'
``load_image`` gives: EXIF-transposed, RGB.

A video is a folder of frames (image files, in name order) or a list of frame references; each
frame is decoded only by the rank that encodes its temporal patch. Video files (mp4, ...) are not
decoded here: extract their frames first (e.g. ``ffmpeg -i clip.mp4 -r 2 clip/%05d.png``).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cpvlm.data.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
_ORIENTATION = 0x0112
_TRANSPOSED = (5, 6, 7, 8)  # EXIF orientations that swap width and height


@dataclass(frozen=True)
class ImageRef:
    """An image file, or its encoded bytes (datasets' ``{"bytes", "path"}``)."""

    path: str | None = None
    data: bytes | None = None

    @property
    def name(self) -> str:
        return self.path or f"<{len(self.data or b'')} bytes>"

    def _open(self):
        from PIL import Image

        if self.data is not None:
            return Image.open(io.BytesIO(self.data))
        if not Path(self.path).is_file():
            raise DataError("missing_media", f"no such file {self.path}")
        return Image.open(self.path)

    def size(self) -> tuple[int, int]:
        """``(height, width)`` after the EXIF orientation, from the header."""
        try:
            with self._open() as im:
                w, h = im.size
                if _orientation(im) in _TRANSPOSED:
                    w, h = h, w
        except DataError:
            raise
        except Exception as err:  # PIL raises several types for a file that is not an image
            raise DataError("unreadable_media", f"{self.name}: {err}") from None
        return h, w

    def load(self):
        """The decoded RGB ``PIL.Image``, upright (as ``transformers.image_utils.load_image``)."""
        from PIL import ImageOps

        try:
            with self._open() as im:
                im = ImageOps.exif_transpose(im)
                return im.convert("RGB")
        except DataError:
            raise
        except Exception as err:
            raise DataError("unreadable_media", f"{self.name}: {err}") from None


def _orientation(im) -> int:
    """The EXIF orientation without decoding: PIL's ``getexif`` decodes a PNG to find an eXIf
    chunk after the image data, so PNG chunks are walked here instead (headers only)."""
    from PIL import Image

    if im.format != "PNG" or "exif" in im.info:
        return im.getexif().get(_ORIENTATION, 1)
    fp = im.fp
    fp.seek(8)  # the PNG signature
    while True:
        head = fp.read(8)
        if len(head) < 8:
            return 1
        length, kind = int.from_bytes(head[:4], "big"), head[4:]
        if kind == b"eXIf":
            exif = Image.Exif()
            exif.load(fp.read(length))
            return exif.get(_ORIENTATION, 1)
        if kind == b"IEND":
            return 1
        fp.seek(length + 4, 1)  # the data and its CRC


def image_ref(value, base_dir: Path | None) -> ImageRef:
    """An ``ImageRef`` from a record's image value: a path (relative to ``base_dir``), a
    ``file://`` path, or ``{"bytes": ..., "path": ...}``."""
    if isinstance(value, Mapping):
        if value.get("bytes"):
            return ImageRef(path=value.get("path"), data=bytes(value["bytes"]))
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return ImageRef(data=bytes(value))
    if not isinstance(value, str) or not value:
        raise DataError("bad_record", f"an image must be a path or {{'bytes': ...}}, got {value!r}")
    if value.startswith(("http://", "https://")):
        raise DataError("bad_record", f"{value}: URLs are not fetched; download the images first")
    value = value.removeprefix("file://")
    path = Path(value)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return ImageRef(path=str(path))


def video_frames(value, base_dir: Path | None) -> tuple[ImageRef, ...]:
    """The frames of a video value: a folder of image files or a list of frame references."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        frames = tuple(image_ref(v, base_dir) for v in value)
    else:
        ref = image_ref(value, base_dir)
        if ref.path is None or not Path(ref.path).is_dir():
            if ref.path is not None and not Path(ref.path).exists():
                raise DataError("missing_media", f"no such video folder {ref.path}")
            raise DataError(
                "unreadable_media",
                f"{ref.name}: videos must be folders of frames (or lists of frame files); "
                "extract the frames of a video file first, e.g. ffmpeg -i clip.mp4 -r 2 "
                "clip/%05d.png",
            )
        files = sorted(p for p in Path(ref.path).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        frames = tuple(ImageRef(path=str(p)) for p in files)
    if not frames:
        raise DataError("missing_media", f"video {value!r} has no frames")
    return frames
