"""Audio clips: where they are, and their samples as a model's feature extractor takes them.

A clip is an audio file (WAV, FLAC, MP3, OGG, M4A, ... : whatever PyAV, the video dependency,
reads; its first audio stream) or its encoded bytes. ``load_audio`` decodes it to mono float32 at
the feature extractor's sampling rate: PyAV's resampler (``fltp``, the file's own channel layout,
the rate asked), then the mean of the channels (as ``librosa.to_mono``, the downmix of
transformers' ``load_audio``; FFmpeg's own ``mono`` layout would scale a stereo sum by
1/sqrt(2) instead). Unlike an image, a clip is decoded while the sample is planned: its token
count follows from its length in samples, which only decoding gives exactly.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cpvlm.data.errors import DataError


@dataclass(frozen=True)
class AudioRef:
    """An audio file, or its encoded bytes (datasets' ``{"bytes", "path"}``)."""

    path: str | None = None
    data: bytes | None = None

    @property
    def name(self) -> str:
        return self.path or f"<{len(self.data or b'')} bytes>"


def audio_ref(value, base_dir: Path | None) -> AudioRef:
    """An ``AudioRef`` from a record's audio value: a path (relative to ``base_dir``), a
    ``file://`` path, or ``{"bytes": ..., "path": ...}``."""
    if isinstance(value, Mapping):
        if value.get("bytes"):
            return AudioRef(path=value.get("path"), data=bytes(value["bytes"]))
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return AudioRef(data=bytes(value))
    if not isinstance(value, str) or not value:
        raise DataError(
            "bad_record", f"an audio clip must be a path or {{'bytes': ...}}, got {value!r}"
        )
    if value.startswith(("http://", "https://")):
        raise DataError("bad_record", f"{value}: URLs are not fetched; download the audio first")
    path = Path(value.removeprefix("file://"))
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return AudioRef(path=str(path))


def load_audio(ref: AudioRef, rate: int) -> np.ndarray:
    """``[samples]`` float32: the clip's first audio stream, resampled to ``rate`` Hz, the mean
    of its channels."""
    try:
        import av
    except ImportError:
        raise DataError(
            "unreadable_media", f"{ref.name}: audio needs PyAV (pip install 'cpvlm[audio]')"
        ) from None
    if ref.data is None and not Path(ref.path).is_file():
        raise DataError("missing_media", f"no such audio file {ref.path}")
    try:
        with av.open(io.BytesIO(ref.data) if ref.data is not None else ref.path) as container:
            if not container.streams.audio:
                raise DataError("unreadable_media", f"{ref.name}: no audio stream")
            resampler = av.AudioResampler(format="fltp", layout=None, rate=rate)
            parts = [
                f.to_ndarray() for fr in container.decode(audio=0) for f in resampler.resample(fr)
            ]
            parts += [f.to_ndarray() for f in resampler.resample(None)]  # the resampler's tail
    except DataError:
        raise
    except Exception as err:  # PyAV raises its own error types for a file it cannot read
        raise DataError("unreadable_media", f"{ref.name}: {err}") from None
    if not parts:
        raise DataError("unreadable_media", f"{ref.name}: no audio samples")
    return np.concatenate(parts, axis=1).mean(0).astype(np.float32)
