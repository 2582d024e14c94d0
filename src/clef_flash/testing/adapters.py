"""Random clef-finetune checkpoints for tests and benchmarks: the layout `clef-finetune train` saves (PEFT's own
adapter_config.json, LoRA pairs in fp32, a whole head), drawn for a random release's config without training."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..checkpoint.adapters import HEAD_FILE, PEFT_PREFIX, WEIGHTS_FILE
from ..checkpoint.names import DECODER_PREFIX
from ..checkpoint.random_release import draw_tensor, head_tensor_table, resolve_config


def write_random_adapter(
    out_dir: str | os.PathLike[str],
    config: str = "tiny",
    *,
    rank: int = 16,
    alpha: float = 32.0,
    seed: int = 0,
    update_scale: float = 0.05,
    suffixes: tuple[str, ...] | None = None,
) -> Path:
    """A checkpoint directory for the random release `config`: rank-`rank` updates on every decoder projection
    (those ending in `suffixes`, if given) whose B is not zero (so that the adapter changes the answers), and the
    release's head drawn with another seed."""
    from peft import LoraConfig

    from ..model.lora import projection_shapes
    from ..model.qwen3_5 import Qwen35Decoder

    random_config = resolve_config(config)
    with torch.device("meta"):
        decoder = Qwen35Decoder(random_config.text)
    projections = {
        name: shape for name, shape in sorted(projection_shapes(decoder).items()) if suffixes is None or name.endswith(suffixes)
    }
    out = Path(out_dir)
    (out / "adapter").mkdir(parents=True, exist_ok=True)
    regex = r"^(?:" + "|".join(re.escape(DECODER_PREFIX + name) for name in projections) + r")$"  # as clef-finetune writes it
    LoraConfig(r=rank, lora_alpha=alpha, target_modules=regex, bias="none").save_pretrained(str(out / "adapter"))
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, (out_features, in_features) in projections.items():
        key = PEFT_PREFIX + DECODER_PREFIX + name
        weights[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
        weights[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * update_scale / rank**0.5
    save_file(weights, str(out / WEIGHTS_FILE))
    head = {spec.name: draw_tensor(spec, seed=seed + 7919) for spec in head_tensor_table(random_config)}
    save_file(head, str(out / HEAD_FILE))
    return out
