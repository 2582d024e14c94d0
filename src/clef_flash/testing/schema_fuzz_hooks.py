"""schemathesis hooks for the fuzz run (loaded through $SCHEMATHESIS_HOOKS by testing/schema_fuzz.py).

The one rule of the published schema that JSON Schema cannot state is that an image's base64 decodes to an
image of its type. A data URI that matches the published pattern gets a real 2x2 image of that
type in its place, so that schema-valid bodies stay valid; every other generated value (the count, the
pattern, negative cases) is sent as generated. tests/test_vision.py refuses undecodable images on its own.
"""

from __future__ import annotations

import base64
import io
import re
from functools import lru_cache

import schemathesis

from ..request.protocol import IMAGE_DATA_URI_PATTERN


@lru_cache(maxsize=None)
def real_image(kind: str) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (2, 2), (200, 30, 30)).save(buffer, format={"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[kind])
    return f"data:image/{kind};base64," + base64.b64encode(buffer.getvalue()).decode()


def with_real_images(body):
    if isinstance(body, dict) and isinstance(body.get("images"), list):
        body["images"] = [
            real_image(match.group(1)) if isinstance(item, str) and (match := re.match(IMAGE_DATA_URI_PATTERN, item)) else item
            for item in body["images"]
        ]
    return body


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    """Every phase's cases (the coverage phase's boundary examples too) just before they are sent."""
    case.body = with_real_images(case.body)
