"""schemathesis hooks for the fuzz run (loaded through $SCHEMATHESIS_HOOKS by testing/schema_fuzz.py).

The rules of the published schema that JSON Schema cannot state are that an image's (or a video's) base64
decodes to an image (a video) of its type, that a video's frames have one size, and the bytes together. A data URI
that matches the published pattern gets a real 2x2 image (a real 2-frame 32x32 video) of that type in its place,
so that schema-valid bodies stay valid; every other generated value (the count, the pattern, negative cases) is
sent as generated. tests/test_vision.py and tests/test_video.py refuse undecodable media on their own.
"""

from __future__ import annotations

import base64
import io
import re
from functools import lru_cache

import schemathesis

from ..request.protocol import IMAGE_DATA_URI_PATTERN, VIDEO_DATA_URI_PATTERN


@lru_cache(maxsize=None)
def real_image(kind: str) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (2, 2), (200, 30, 30)).save(buffer, format={"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[kind])
    return f"data:image/{kind};base64," + base64.b64encode(buffer.getvalue()).decode()


@lru_cache(maxsize=None)
def real_video(kind: str) -> str:
    import av
    import numpy as np

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=kind) as container:
        stream = container.add_stream({"mp4": "libx264", "webm": "libvpx-vp9"}[kind], rate=2)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for shade in (60, 200):
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.full((32, 32, 3), shade, dtype=np.uint8), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return f"data:video/{kind};base64," + base64.b64encode(buffer.getvalue()).decode()


def _real_images(items: list) -> list:
    return [real_image(match.group(1)) if isinstance(item, str) and (match := re.match(IMAGE_DATA_URI_PATTERN, item)) else item for item in items]


def _real_video(item):
    if isinstance(item, list):
        return _real_images(item)
    if isinstance(item, str) and (match := re.match(VIDEO_DATA_URI_PATTERN, item)):
        return real_video(match.group(1))
    return item


def with_real_images(body):
    if isinstance(body, dict) and isinstance(body.get("images"), list):
        body["images"] = _real_images(body["images"])
    if isinstance(body, dict) and isinstance(body.get("videos"), list):
        body["videos"] = [_real_video(item) for item in body["videos"]]
    return body


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    """Every phase's cases (the coverage phase's boundary examples too) just before they are sent."""
    case.body = with_real_images(case.body)
