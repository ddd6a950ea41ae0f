"""Images and video frames: where they are, their size from the file header, and decoding.

Sizes come from the header alone (PIL reads it without decoding the pixels), with the EXIF
orientation applied, so that every rank can compute the grids and token counts of every image
while only the rank that encodes an image decodes it. Decoding gives what transformers'
``load_image`` gives: EXIF-transposed, RGB.

A video is a folder of frames (image files, in name order), a list of frame references, or a
video file (mp4, mkv, webm, mov, avi; read with PyAV, the ``[video]`` extra). A video file's frames
are sampled at the record's ``fps`` (default 2 per second, as common video processors sample):
``n = min(total, max(1, int(total / file_fps * fps)))`` frames at ``int(i * total / n)``, and the
frame count and size come from the container (packets counted, nothing decoded). Each frame is
decoded only by the rank that encodes its temporal patch: a rank decodes a file from its start
up to the last frame it needs (frames are counted, not sought by timestamp, which variable frame
rates make inexact). Rotation metadata of a file is not applied (frames as stored).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cpvlm.data.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".m4v", ".mkv", ".webm", ".mov", ".avi")
DEFAULT_VIDEO_FPS = 2.0  # frames sampled per second of a video file when the record gives none
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


@dataclass(frozen=True)
class VideoFrameRef:
    """Frame ``index`` (in decoding order) of a video file, whose frames are ``height x width``
    (from the container); ``size`` and ``load`` as ``ImageRef``'s."""

    path: str
    index: int
    height: int
    width: int

    @property
    def name(self) -> str:
        return f"{self.path}#frame{self.index}"

    def size(self) -> tuple[int, int]:
        return self.height, self.width

    def load(self):
        return load_frames([self])[0]


def _open_video(path: str):
    try:
        import av
    except ImportError:
        raise DataError(
            "unreadable_media",
            f"{path}: video files need PyAV (pip install 'cpvlm[video]'), or give a folder of "
            "frames",
        ) from None
    if not Path(path).is_file():
        raise DataError("missing_media", f"no such video file {path}")
    try:
        container = av.open(path)
        if not container.streams.video:
            container.close()
            raise DataError("unreadable_media", f"{path}: no video stream")
    except DataError:
        raise
    except Exception as err:  # PyAV raises its own error types for a file it cannot read
        raise DataError("unreadable_media", f"{path}: {err}") from None
    return container


def _video_info(path: str) -> tuple[int, int, int, float]:
    """``(frames, height, width, fps)`` of a video file, from its container (no decoding)."""
    with _open_video(path) as container:
        stream = container.streams.video[0]
        height, width = stream.codec_context.height, stream.codec_context.width
        rate = stream.average_rate or stream.guessed_rate
        try:
            frames = sum(1 for packet in container.demux(stream) if packet.size)
        except Exception as err:
            raise DataError("unreadable_media", f"{path}: {err}") from None
    if not frames or not rate or not height or not width:
        raise DataError("unreadable_media", f"{path}: no frames, size or frame rate")
    return frames, height, width, float(rate)


def load_frames(refs) -> list:
    """Decoded RGB ``PIL.Image``s of ``refs`` (``ImageRef`` / ``VideoFrameRef``), in order; each
    video file is decoded once, from its start up to the last frame asked of it."""
    out: list = [None] * len(refs)
    by_file: dict[str, list[int]] = {}
    for i, ref in enumerate(refs):
        if isinstance(ref, VideoFrameRef):
            by_file.setdefault(ref.path, []).append(i)
        else:
            out[i] = ref.load()
    for path, slots in by_file.items():
        wanted = {refs[i].index for i in slots}
        frames = {}
        with _open_video(path) as container:
            try:
                for k, frame in enumerate(container.decode(video=0)):
                    if k in wanted:
                        frames[k] = frame.to_image().convert("RGB")
                    if len(frames) == len(wanted):
                        break
            except Exception as err:
                raise DataError("unreadable_media", f"{path}: {err}") from None
        for i in slots:
            if refs[i].index not in frames:
                raise DataError("unreadable_media", f"{refs[i].name}: the file ends before it")
            out[i] = frames[refs[i].index]
    return out


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


def video_frames(value, base_dir: Path | None, fps: float | None = None):
    """``(frames, fps)`` of a video value: a folder of image files or a list of frame references
    (all frames; ``fps`` as given), or a video file (frames sampled at ``fps``, default
    ``DEFAULT_VIDEO_FPS``; the rate of the sampled frames returned)."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        frames = tuple(image_ref(v, base_dir) for v in value)
    else:
        ref = image_ref(value, base_dir)
        if ref.path is not None and Path(ref.path).suffix.lower() in VIDEO_SUFFIXES:
            return _sampled_frames(ref.path, fps)
        if ref.path is None or not Path(ref.path).is_dir():
            if ref.path is not None and not Path(ref.path).exists():
                raise DataError("missing_media", f"no such video {ref.path}")
            raise DataError(
                "unreadable_media",
                f"{ref.name}: a video must be a video file ({', '.join(VIDEO_SUFFIXES)}), a "
                "folder of frames or a list of frame files",
            )
        files = sorted(p for p in Path(ref.path).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        frames = tuple(ImageRef(path=str(p)) for p in files)
    if not frames:
        raise DataError("missing_media", f"video {value!r} has no frames")
    return frames, fps


def _sampled_frames(path: str, fps: float | None) -> tuple[tuple[VideoFrameRef, ...], float]:
    fps = DEFAULT_VIDEO_FPS if fps is None else fps
    if not fps > 0:
        raise DataError("bad_record", f"{path}: fps must be > 0, got {fps}")
    total, height, width, file_fps = _video_info(path)
    n = min(total, max(1, int(total / file_fps * fps)))
    frames = tuple(VideoFrameRef(path, i * total // n, height, width) for i in range(n))
    return frames, n * file_fps / total
