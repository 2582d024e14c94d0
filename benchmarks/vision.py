"""The cost of an image: the full-size Qwen3.5-9B vision tower (random weights in memory) on this machine.

    python benchmarks/vision.py [--dtypes bf16,fp32] [--sizes 448x448,1024x768] [--repeats 2] [--threads N]

For each size: the image's tokens in the decoder (the release's processor: patch 16, merge 2x2, 256x256 to
16 MP), preprocessing milliseconds (Pillow, request/images.py) and the tower's seconds (median of --repeats
after one warm-up), per dtype (bf16: as released and under int8 plans; fp32: the fp32 plan). Also the tower's
parameters and memory. The decoder's cost for those tokens is that of as many text tokens (README's table).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from clef_flash.model.vision import VisionConfig, VisionTower
from clef_flash.request.images import ImageProcessorConfig, preprocess_image
from clef_flash.checkpoint.random_release import processor_configs

# transformers' Qwen3_5VisionConfig (the 9B release's vision_config): 27 blocks of 1152, 16 heads.
QWEN3_5_9B_VISION = VisionConfig(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096, num_position_embeddings=2304
)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def tower(dtype: torch.dtype) -> VisionTower:
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = VisionTower(QWEN3_5_9B_VISION)
    for name, parameter in model.named_parameters():  # random, O(1) activations
        with torch.no_grad():
            if parameter.ndim >= 2:
                parameter.normal_(0, parameter[0].numel() ** -0.5)
            elif "norm" in name and name.endswith("weight"):
                parameter.fill_(1.0)
            else:
                parameter.normal_(0, 0.02)
    return model.to(dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--sizes", default="448x448,1024x768")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from PIL import Image

    processor = ImageProcessorConfig.from_dict(processor_configs()["preprocessor_config.json"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    for dtype_name in args.dtypes.split(","):
        model = tower(DTYPES[dtype_name])
        parameters = sum(p.numel() for p in model.parameters())
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        print(f"{dtype_name}: {parameters / 1e6:.0f} M parameters, {nbytes / 2**20:.0f} MiB")
        for size in args.sizes.split(","):
            width, height = map(int, size.split("x"))
            image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8))
            started = time.perf_counter()
            pixels, grid = preprocess_image(image, processor)
            preprocess_ms = (time.perf_counter() - started) * 1000
            pixel_values = torch.from_numpy(pixels)
            seconds = []
            with torch.inference_mode():
                for _ in range(args.repeats + 1):
                    started = time.perf_counter()
                    features = model(pixel_values, [grid])
                    seconds.append(time.perf_counter() - started)
            tokens = features.shape[0]
            print(
                f"  {size}: grid {grid}, {tokens} tokens, preprocess {preprocess_ms:.0f} ms, "
                f"tower {statistics.median(seconds[1:]):.2f} s (median of {args.repeats}), load {os.getloadavg()[0]:.2f}"
            )


if __name__ == "__main__":
    main()
