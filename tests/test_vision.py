"""Images in the state (issue 26): parity with the reference on a random release with a vision tower, batch
invariance, text-only records untouched by M-RoPE, and every refusal through the API and the server.

The reference is Cloudflare's `joint_schema_model.py` (SPEC §8) on transformers' `Qwen3_5ForConditionalGeneration`,
fp32, with the release's `AutoProcessor` as the reference's own dependencies install it: with torchvision, whose
image processor (`Qwen2VLImageProcessor`, the torchvision backend) resizes with torch's antialiased bicubic, not
Pillow's. torchvision does not import beside this torch, so the reference runs in the oracle venv: the
`reference_oracle` fixture (tests/conftest.py; skipped, saying so, where CLEF_FLASH_ORACLE_PYTHON is unset).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import clef_flash
from clef_flash.errors import RecordTooLong, RequestInvalid
from clef_flash.model.qwen3_5 import mrope_cos_sin, rotary_cos_sin

Image = pytest.importorskip("PIL.Image")

# The test release keeps images small: at most 512x512 pixels after resizing (the real release: 16 MP), so
# that the 640x480 image below is resized down, as a large photo is by the real one.
MAX_PIXELS = 512 * 512


@pytest.fixture(scope="module")
def release(vision_release) -> Path:
    return vision_release("vision", 3, preprocessor_config=MAX_PIXELS)


@pytest.fixture(scope="module")
def clef(release):
    return clef_flash.load(str(release), precision="fp32")


def picture(width: int, height: int, seed: int, mode: str = "RGB"):
    """Smooth colour ramps plus noise: resizing has something to do."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    if mode == "RGBA":
        image.putalpha(Image.fromarray(rng.integers(0, 255, (height, width), dtype=np.uint8)))
    return image


def encoded(image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def data_uri(image, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(encoded(image, fmt)).decode()


QUESTIONS = {
    "kind": {"type": "choice", "instructions": "What is shown?", "criteria": {"receipt": "A receipt", "photo": None, "chart": "A chart"}},
    "urgent": {"type": "noul", "instructions": "Is it urgent?"},
    "quality": {"type": "score", "instructions": "How clear is it?", "criteria": ["blurry", "fair", "sharp"]},
}

CASES = {
    # one tiny image: resized up to the processor's minimum (256x256 pixels)
    "1-tiny": ("Ticket 4312: see the screenshot.", [picture(40, 24, 1)]),
    # two aspect ratios, one with alpha (composited over white), one JPEG
    "2-aspects": ("Two photos of the parcel.", [picture(300, 120, 2, mode="RGBA"), picture(96, 410, 3)]),
    # four sizes, one resized down (640x480 over the 512x512 maximum), a JSON state
    "4-json": (
        {"order": 81, "items": ["lamp", "cable"], "note": "damaged on arrival"},
        [picture(640, 480, 4), picture(33, 70, 5), picture(256, 256, 6), picture(200, 150, 7)],
    ),
}


def as_request(state, images, *, form=data_uri):
    return {"model": "clef-flash", "state": state, "images": [form(image) for image in images], "questions": QUESTIONS}


@pytest.fixture(scope="module")
def oracle(release, reference_oracle, module_tmp) -> dict[str, tuple[dict, dict]]:
    """The reference's outputs for each case, its images given as the PNG files the requests carry."""
    folder = module_tmp("images")
    records = []
    for case, (state, images) in CASES.items():
        paths = []
        for index, image in enumerate(images):
            paths.append(folder / f"{case}-{index}.png")
            paths[-1].write_bytes(encoded(image))
        records.append({"state": state, "questions": QUESTIONS, "images": [str(path) for path in paths]})
    return dict(zip(CASES, reference_oracle(release, records)))


@pytest.mark.slow  # a long end-to-end or oracle run: the full suite (CI) runs it, the quick loop does not
@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_the_reference(clef, oracle, oracle_parity, case):
    print(f"{case}: {oracle_parity(clef, as_request(*CASES[case]), oracle[case])}")


def test_python_forms_give_the_same_record(clef, tmp_path):
    image = picture(120, 90, 8)
    path = tmp_path / "shot.png"
    path.write_bytes(encoded(image))
    records = [
        clef.encode(as_request("s", [image], form=form))
        for form in (data_uri, lambda im: im, encoded, lambda im: path)
    ]
    assert len({record.input_ids for record in records}) == 1
    assert all(np.array_equal(record.media.pixel_values, records[0].media.pixel_values) for record in records)
    # a JPEG and a WebP decode with Pillow too
    for fmt in ("JPEG", "WEBP"):
        assert clef.encode(as_request("s", [image], form=lambda im: data_uri(im, fmt))).media.grids == records[0].media.grids


def test_batch_invariance_with_text_records(clef):
    state, images = CASES["2-aspects"]
    request = as_request(state, images)
    text = [{"state": f"plain text record {i} " * (i + 1), "questions": QUESTIONS} for i in range(3)]
    alone = clef.logits(request)
    texts_alone = [clef.logits(record) for record in text]
    together = clef.answer_many([text[0], request, text[1], text[2]], decimals=None)
    mixed = clef.score([clef.encode(r) for r in [text[0], request, text[1], text[2]]])
    assert len(together) == 4 and together[1]["usage"]["input_tokens"] == clef.encode(request).token_count
    worst = 0.0
    for expected, results in zip([texts_alone[0], alone, texts_alone[1], texts_alone[2]], mixed):
        for result in results:
            want = torch.tensor([expected[result.question_id][o] for o in result.option_ids], dtype=torch.float64)
            worst = max(worst, ((torch.tensor(result.logits) - want).abs().max() / want.abs().max()).item())
    print(f"image record alone vs batched with text records: rel {worst:.1e}")
    assert worst <= 1e-5


def test_text_positions_are_bit_identical_through_mrope(clef):
    config = clef.parts.decoder.config
    positions = torch.arange(5, 5 + 37)
    cos, sin = rotary_cos_sin(config, 5, 37, torch.float32, torch.device("cpu"))
    cos3, sin3 = mrope_cos_sin(config, positions.expand(3, 1, -1), torch.float32, torch.device("cpu"))
    assert torch.equal(cos3[0], cos) and torch.equal(sin3[0], sin)
    ids = torch.tensor([clef.encode({"state": "text only", "questions": QUESTIONS}).input_ids])
    with torch.no_grad():
        plain = clef.parts.decoder(ids)
        through = clef.parts.decoder(ids, positions=torch.arange(ids.shape[1]).expand(3, 1, -1))
    assert torch.equal(plain, through)


def test_vision_tokens_count_against_the_token_limit(release):
    small = clef_flash.load(str(release), precision="fp32", max_length=300)
    with pytest.raises(RecordTooLong) as caught:
        small.encode(as_request("s", [picture(600, 400, 9)]))
    assert caught.value.token_count > 300 and "300" in str(caught.value)


def test_a_text_only_source_refuses_images(release, tmp_path):
    text_only = tmp_path / "text-only"
    text_only.mkdir()
    for path in release.iterdir():
        if path.name not in ("preprocessor_config.json", "video_preprocessor_config.json"):
            (text_only / path.name).symlink_to(path)
    model = clef_flash.load(str(text_only), precision="fp32")
    with pytest.raises(RequestInvalid) as caught:
        model.answer(as_request("s", [picture(20, 20, 1)]))
    assert caught.value.errors[0]["type"] == "images_unsupported" and caught.value.errors[0]["loc"] == ["body", "images"]


def _png_of_pixels(width: int, height: int) -> str:
    return "data:image/png;base64," + base64.b64encode(encoded(Image.new("L", (width, height)))).decode()


def _noise_png(nbytes: int) -> str:
    side = int((nbytes / 3) ** 0.5) + 8
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (side, side, 3), dtype=np.uint8))
    return data_uri(image)


REFUSALS = [
    ("remote-url", lambda: ["https://example.com/cat.png"], ["body", "images", 0], "image_url_refused"),
    ("not-a-uri", lambda: ["/etc/passwd"], ["body", "images", 0], "image_type"),
    ("bad-base64", lambda: [_png_of_pixels(4, 4), "data:image/png;base64,!!!!"], ["body", "images", 1], "image_base64"),
    ("gif", lambda: ["data:image/gif;base64,R0lGODlhAQABAAAAACw="], ["body", "images", 0], "image_format"),
    ("undecodable", lambda: ["data:image/png;base64," + base64.b64encode(b"not a png").decode()], ["body", "images", 0], "image_undecodable"),
    ("too-many-pixels", lambda: [_png_of_pixels(5000, 4000)], ["body", "images", 0], "image_too_many_pixels"),
    ("too-large", lambda: [_noise_png(4_300_000)], ["body", "images", 0], "image_too_large"),
    ("too-large-together", lambda: [_noise_png(3_000_000)] * 3, ["body", "images"], "images_too_large"),
    ("too-many", lambda: [_png_of_pixels(4, 4)] * 5, ["body", "images"], "too_many_images"),
]


@pytest.fixture(scope="module")
def refusal_bodies():
    return {name: make() for name, make, _, _ in REFUSALS}


@pytest.mark.parametrize(("name", "loc", "error_type"), [(n, l, t) for n, _, l, t in REFUSALS], ids=[n for n, *_ in REFUSALS])
def test_refusals_through_the_api_and_the_server(clef, server, refusal_bodies, name, loc, error_type):
    request = {"state": "s", "questions": {"q": {"type": "noul"}}, "images": refusal_bodies[name]}
    with pytest.raises(RequestInvalid) as caught:
        clef.answer(request)
    item = caught.value.errors[0]
    assert (item["loc"], item["type"]) == (loc, error_type), item
    assert len(json.dumps(item)) < 1000  # the image is never echoed back
    response = server.post("/v1/systemone", content=json.dumps(request).encode())
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert (detail["loc"], detail["type"]) == (loc, error_type)


@pytest.fixture(scope="module")
def server(clef):
    from fastapi.testclient import TestClient

    from clef_flash.server import create_app

    with TestClient(create_app(clef, batch_wait_ms=0, warm_up=False)) as client:
        yield client


def test_server_answers_images_past_the_text_body_limit(clef, server):
    big_image = _noise_png(1_500_000)  # a 2 MB body: over the 1 MiB text limit, within the image limit
    body = json.dumps(as_request("s", []) | {"images": [big_image]}).encode()
    assert len(body) > 1 << 20
    response = server.post("/v1/systemone", content=body)
    assert response.status_code == 200, response.text[:300]
    assert response.json()["usage"]["input_tokens"] == clef.encode(json.loads(body)).token_count
    text = json.dumps({"state": "x" * (1 << 20), "questions": QUESTIONS}).encode()
    refused = server.post("/v1/systemone", content=text)
    assert refused.status_code == 413 and "without images" in refused.json()["detail"]


def test_state_reuse_keys_on_the_images(clef, kept_state_error):
    """Two records with the same images and state share one prefix + state run; the same state with other
    images of the same sizes (the same tokens) is not mistaken for it."""
    state, images = CASES["2-aspects"]
    other_images = [picture(image.width, image.height, seed=40 + n, mode=image.mode) for n, image in enumerate(images)]
    first = as_request(state, images)
    second = as_request(state, images) | {"questions": {"urgent": QUESTIONS["urgent"], "kind": QUESTIONS["kind"]}}
    third = as_request(state, other_images)
    assert clef.encode(first).input_ids[:200] == clef.encode(third).input_ids[:200]
    worst = kept_state_error(clef, first, second, third)
    print(f"records continuing a kept state with images (or not) vs from the start: rel {worst:.1e}")
    assert worst <= 1e-5


def test_segments_split_an_image(clef, segments_error):
    """A record run in 50-token segments (its image pads cut across them) equals one pass."""
    worst = segments_error(clef, as_request(*CASES["2-aspects"]), 50)
    print(f"50-token segments vs one pass: rel {worst:.1e}")
    assert worst <= 1e-5
