"""The cost of a video at 448x448 on the random `tiny-vision` release: decoding, the release's video processor and
the answer, per video (the tiny tower and decoder cost little: this measures the host side).

    python benchmarks/video.py [--seconds 10] [--fps 30] [--frames-list 8] [--repeats 3] [--threads 1]

Two videos of 448x448 frames: an MP4 of --seconds at --fps (H.264, written with PyAV; sampled at the processor's
2 fps), and a list of --frames-list PNG frames (a list is a 24 fps clip: max(4, N // 12) frames kept). For each:
its frames kept, frame pairs and decoder tokens, and the medians of --repeats (after one warm-up) of: validating
(`parse_request`: decoding data URIs, reading the container's header), encoding (sampling, decoding the kept
frames, resizing, patches, the prompt) and the answer of one record (encoding, the tower and the decoder, fp32).
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys
import tempfile
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median_ms  # noqa: E402

import clef_flash  # noqa: E402
from clef_flash.checkpoint.random_release import write_random_release  # noqa: E402
from clef_flash.request.protocol import parse_request  # noqa: E402

QUESTIONS = {"damaged": {"type": "noul", "instructions": "Is the parcel damaged?"}}


def frames(count: int, side: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:side, 0:side]
    return [
        np.clip(np.stack([(x + 3 * i) % 256, (y + 5 * i) % 256, (x + y) % 256], -1) + rng.integers(-20, 20, (side, side, 3)), 0, 255).astype(np.uint8)
        for i in range(count)
    ]


def mp4(pixels: list[np.ndarray], fps: int) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = pixels[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for array in pixels:
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def png_uri(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--fps", type=int, default=30)
    parser.add_argument("--frames-list", type=int, default=8)
    parser.add_argument("--side", type=int, default=448)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        release = write_random_release(Path(tmp) / "release", "tiny-vision", seed=0)
        model = clef_flash.load(str(release), precision="fp32", state_cache_mb=0)
        clip = mp4(frames(args.seconds * args.fps, args.side), args.fps)
        videos = {
            f"MP4 {args.seconds} s at {args.fps} fps ({len(clip) / 1e6:.1f} MB)": "data:video/mp4;base64," + base64.b64encode(clip).decode(),
            f"list of {args.frames_list} PNG frames": [png_uri(array) for array in frames(args.frames_list, args.side)],
        }
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
        for name, video in videos.items():
            body = {"state": "See the clip.", "questions": QUESTIONS, "videos": [video]}
            request = parse_request(body)
            record = model.encode(request)
            kept = 2 * record.media.grids[0][0]
            validate, encode, answer = (
                median_ms(run, repeats=args.repeats, warmup=1)
                for run in (lambda: parse_request(body), lambda: model.encode(request), lambda: model.answer(request))
            )
            print(
                f"{name}: {args.side}x{args.side}, {kept} frames kept, grid {record.media.grids[0]}, {record.media.tokens} video "
                f"tokens of {record.token_count}; validate {validate:.0f} ms, encode {encode:.0f} ms, "
                f"answer {answer:.0f} ms (medians of {args.repeats}), load {os.getloadavg()[0]:.2f}"
            )


if __name__ == "__main__":
    main()
