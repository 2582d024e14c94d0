"""Images in a request: decoding with the hosted limits, and the release's image processor (pure host code).

Accepted forms: in a request body, data URIs `data:image/png|jpeg|webp;base64,...` (remote URLs are refused:
the server fetches nothing on a caller's behalf); in Python also PIL images, bytes and `pathlib.Path`s (a
plain string is never read as a path, so a body cannot name a file on the server). Limits as the hosted API:
at most 4 images, 4 MiB each and 8 MiB together (decoded bytes), 16 megapixels each.

Preprocessing is the release's `preprocessor_config.json` exactly as transformers' `Qwen2VLImageProcessor` (the
torchvision backend: what `AutoProcessor` gives for a Qwen3.5 release where torchvision is installed, as it is with
the reference's dependencies) computes it: RGB (alpha composited over white with Pillow, `convert_to_rgb`) ->
`smart_resize` to multiples of patch x merge within [shortest_edge, longest_edge] pixels -> torch's antialiased
bicubic on the uint8 pixels (torchvision's CPU kernel) -> (x - 255 mean) / (255 std) in float32 -> patches
[N, C * temporal_patch * patch²] in merge-block order, the frame repeated over the temporal patch. The resize,
normalization and patches are the ones the video processor uses (request/videos.py).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

MAX_IMAGES = 4
MAX_IMAGE_BYTES = 4 * 1024 * 1024
MAX_TOTAL_IMAGE_BYTES = 8 * 1024 * 1024
MAX_IMAGE_PIXELS = 16 * 1024 * 1024
FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}


class MediaProblem(ValueError):
    """What is wrong with one image or video: `kind` is the 422 item's type, the message says what to fix."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, eq=False)
class RequestImage:
    """A decoded image: its pixels (an RGB-convertible PIL image) and a digest of what was sent."""

    image: Any  # PIL.Image.Image, loaded
    digest: str  # sha256 of the encoded bytes (or of mode, size and pixels for a PIL image)
    nbytes: int  # encoded bytes (pixel bytes for a PIL image)


def _pil():
    try:
        from PIL import Image
    except ImportError as error:  # pragma: no cover - Pillow is a dependency
        raise MediaProblem("image_unsupported", "images need Pillow: pip install 'clef-flash[vision]'") from error
    return Image


def decode_image(value: Any) -> RequestImage:
    """One image in any accepted form -> a `RequestImage`, or `MediaProblem`."""
    Image = _pil()
    if isinstance(value, RequestImage):
        return value
    if isinstance(value, Image.Image):
        _check_pixels(value.size)
        pixels = value.tobytes()
        digest = hashlib.sha256(f"{value.mode}:{value.size}:".encode() + pixels).hexdigest()
        return RequestImage(value, digest, len(pixels))
    data = encoded_bytes(value, IMAGE_URIS)
    if data is None:
        raise MediaProblem(
            "image_type", f"an image is a data URI string (in Python also a PIL image, bytes or a Path); got {type(value).__name__}"
        )
    try:
        image = Image.open(io.BytesIO(data))
    except Exception:
        raise MediaProblem("image_undecodable", "the image could not be decoded as PNG, JPEG or WebP") from None
    if image.format not in set(FORMATS.values()):
        raise MediaProblem("image_format", f"images must be PNG, JPEG or WebP; got {image.format}")
    _check_pixels(image.size)
    try:
        image.load()
    except Exception:
        raise MediaProblem("image_undecodable", f"the {image.format} image is truncated or corrupt") from None
    return RequestImage(image, hashlib.sha256(data).hexdigest(), len(data))


def _check_pixels(size: tuple[int, int]) -> None:
    width, height = size
    if width * height > MAX_IMAGE_PIXELS:
        raise MediaProblem(
            "image_too_many_pixels", f"an image may have at most {MAX_IMAGE_PIXELS} pixels (16 MP); got {width}x{height}"
        )
    if width < 1 or height < 1:
        raise MediaProblem("image_undecodable", f"the image is empty ({width}x{height})")


@dataclass(frozen=True)
class DataUris:
    """What a kind of media accepts as encoded bytes: data URIs of `subtypes` under `kind`/, at most `max_bytes`."""

    kind: str  # "image" or "video": the media type's prefix and the 422 types' prefix
    subtypes: tuple[str, ...]  # "png", "jpeg", ...
    max_bytes: int
    limit: str  # the byte limit in words, "4 MiB"

    @property
    def one(self) -> str:
        return ("an " if self.kind[0] in "aeiou" else "a ") + self.kind

    @property
    def example(self) -> str:
        return f"data:{self.kind}/{self.subtypes[0]};base64,..."

    @property
    def alternatives(self) -> str:
        return "|".join(subtype for subtype in self.subtypes if subtype != "jpg")

    @property
    def types(self) -> str:
        names = [f"{self.kind}/{subtype}" for subtype in self.subtypes if subtype != "jpg"]
        return ", ".join(names[:-1]) + " or " + names[-1]


IMAGE_URIS = DataUris("image", tuple(FORMATS), MAX_IMAGE_BYTES, "4 MiB")


def encoded_bytes(value: Any, uris: DataUris) -> bytes | None:
    """The encoded bytes of a data URI string, bytes or a `Path` (at most `uris.max_bytes`); None for another type.
    A plain string is never read as a path: a request body cannot name a file on the server."""
    kind = uris.kind
    if isinstance(value, str):
        data = _data_uri(value, uris)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, Path):
        try:
            data = value.read_bytes()
        except OSError as error:
            raise MediaProblem(f"{kind}_unreadable", f"cannot read {value}: {error.strerror or error}") from None
    else:
        return None
    if len(data) > uris.max_bytes:
        raise MediaProblem(f"{kind}_too_large", f"{uris.one} may have at most {uris.max_bytes} bytes ({uris.limit}); got {len(data)}")
    return data


def _data_uri(text: str, uris: DataUris) -> bytes:
    kind = uris.kind
    lowered = text[:16].lower()
    if lowered.startswith(("http://", "https://", "ftp://", "file:")):
        raise MediaProblem(f"{kind}_url_refused", f"remote {kind} URLs are not fetched; send the {kind} as a data URI ({uris.example})")
    if not lowered.startswith("data:"):
        raise MediaProblem(f"{kind}_type", f"{uris.one} must be a data URI: data:{kind}/{uris.alternatives};base64,...")
    header, comma, payload = text.partition(",")
    media_type, _, encoding = header[5:].partition(";")
    if not comma or encoding.lower() != "base64":
        raise MediaProblem(f"{kind}_type", f"{uris.one} data URI must be base64: {uris.example}")
    subtype = media_type.lower().removeprefix(f"{kind}/")
    if not media_type.lower().startswith(f"{kind}/") or subtype not in uris.subtypes:
        raise MediaProblem(f"{kind}_format", f"{kind}s must be {uris.types}; got {media_type or 'no type'}")
    if len(payload) > 4 * math.ceil(uris.max_bytes / 3) + 4:
        raise MediaProblem(f"{kind}_too_large", f"{uris.one} may have at most {uris.max_bytes} bytes ({uris.limit})")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaProblem(f"{kind}_base64", f"the {kind} data URI is not valid base64") from None


# ------------------------------------------------------------------------------------------------
# The release's image processor


@dataclass(frozen=True)
class ImageProcessorConfig:
    """`preprocessor_config.json` (the keys the Qwen2-VL image processor reads)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    resample: int = 3  # bicubic (PIL's number), the only one supported

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], name: str = "preprocessor_config.json") -> ImageProcessorConfig:
        """The keys of `config` (the file `name`, for errors); only bicubic resizing, as the processors' default."""
        size = config.get("size") or {}
        kwargs: dict[str, Any] = {}
        for key, source in (("min_pixels", size.get("shortest_edge")), ("max_pixels", size.get("longest_edge"))):
            value = config.get(key, source)
            if value is not None:
                kwargs[key] = int(value)
        for key in ("patch_size", "temporal_patch_size", "merge_size", "resample"):
            if config.get(key) is not None:
                kwargs[key] = int(config[key])
        for key in ("image_mean", "image_std"):
            if config.get(key) is not None:
                kwargs[key] = tuple(float(v) for v in config[key])
        if config.get("rescale_factor") is not None:
            kwargs["rescale_factor"] = float(config["rescale_factor"])
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if config.get(flag) is False:
                raise ValueError(f"{name}: {flag}=false is not supported")
        if kwargs.get("resample", 3) != 3:
            raise ValueError(f"{name}: resample={kwargs['resample']} is not supported (only bicubic, 3)")
        return cls(**kwargs)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Multiples of `factor` near (height, width), aspect kept, pixels within [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise MediaProblem("image_aspect", f"an image's aspect ratio must be under 200; got {width}x{height}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Any) -> Any:
    """RGB as transformers converts: an image with alpha (or a transparency key) over white."""
    Image = _pil()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def preprocess_image(image: Any, config: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One PIL image -> (pixel_values [h*w, C*T*p*p] float32, grid (1, h, w) in patches)."""
    import torch

    pixels = torch.from_numpy(np.array(to_rgb(image))).permute(2, 0, 1)  # [C, H, W] uint8
    size = smart_resize(*pixels.shape[-2:], config.factor, config.min_pixels, config.max_pixels)
    patches, grid = patchify(normalize(resize(pixels[None], size), config), config)
    return patches.numpy(), grid


def resize(frames: Any, size: tuple[int, int]) -> Any:
    """Frames [T, C, H, W] -> [T, C, *size] as torchvision's `resize` (bicubic, antialiased) does on CPU: torch's
    own kernel, on uint8 as it comes (or float); the frames as they are when they have that size."""
    import torch.nn.functional as F

    if tuple(frames.shape[-2:]) == tuple(size):
        return frames
    return F.interpolate(frames.contiguous(), size=list(size), mode="bicubic", align_corners=False, antialias=True)


def normalize(frames: Any, config: ImageProcessorConfig) -> Any:
    """Rescale and normalize fused, as transformers' torchvision backend does: (x - 255 mean) / (255 std) in float32."""
    import torch

    mean = (torch.tensor(config.image_mean) * (1.0 / config.rescale_factor)).view(-1, 1, 1)
    std = (torch.tensor(config.image_std) * (1.0 / config.rescale_factor)).view(-1, 1, 1)
    return (frames.float() - mean) / std


def patchify(frames: Any, config: ImageProcessorConfig) -> tuple[Any, tuple[int, int, int]]:
    """Normalized frames [T, C, H, W] -> (patches [t * h * w, C * temporal_patch * p²], grid (t, h, w)) in (temporal
    patch, merge block) order; the last frame repeated to whole temporal patches (an image: its one frame, t times)."""
    import torch

    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    if pad := -len(frames) % t:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    T, C, H, W = frames.shape
    grid = (T // t, H // p, W // p)
    patches = frames.reshape(grid[0], t, C, grid[1] // m, m, p, grid[2] // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [t, h/m, w/m, m, m, C, T_patch, p, p]
    return patches.reshape(grid[0] * grid[1] * grid[2], C * t * p * p), grid
