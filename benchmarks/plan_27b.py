"""The plan the default would choose for a full-size Clef 27B (issue 43), from its shapes alone: no weights drawn or written.

    python benchmarks/plan_27b.py [--memory-gib 24] [--config 27b]

`random:27b` opens as a checkpoint of Qwen3.5-27B's shapes (model/config.py QWEN3_5_27B, the head at 5120) whose tensors
would be drawn only when read; `plan.resolve` needs their shapes and this machine's probe (its W8A8 kernel).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from clef_flash.checkpoint import open_checkpoint
from clef_flash.machine import rates as machine_rates
from clef_flash.plan import resolve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory-gib", type=float, default=24.0, help="memory available when loading (default 24)")
    parser.add_argument("--config", default="27b", help="a random config name (27b, 9b, 27b-part, ...)")
    args = parser.parse_args()
    checkpoint = open_checkpoint(f"random:{args.config}")
    plan = resolve(checkpoint, torch.device("cpu"), None, rates=machine_rates, available_memory=lambda: int(args.memory_gib * 2**30))
    layers = checkpoint.layer_parameters()
    print(json.dumps({
        "config": args.config,
        "weights": dataclasses.asdict(checkpoint.weight_counts()),
        "bf16_gib": round(checkpoint.weight_counts().bytes_in("bf16") / 2**30, 1),
        "int8_gib": round(checkpoint.weight_counts().bytes_in("int8-w8a8") / 2**30, 1),
        "layers": len(layers),
        "largest_layer_parameters": max(layers),
        "memory_gib": args.memory_gib,
        "plan": plan.describe(),
    }, indent=2))


if __name__ == "__main__":
    main()
