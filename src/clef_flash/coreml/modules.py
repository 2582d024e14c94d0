"""The export twins filled from a checkpoint, one part at a time (what the exporter and the torch stand-in trace).

A part holds only its own layers' tensors: the exporter streams the decoder part by part. From an 8-bit
bundle the projections are brought back to their plain form, `W ~ dequantize(q, scale) R^T / s` (undoing the int8
scheme's rotation and smoothing, checkpoint/quant.py), and Core ML's per-channel quantizer rounds that to 8 bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..checkpoint import Checkpoint
from ..checkpoint.loading import fill_module, meta_modules
from ..checkpoint.names import DECODER_PREFIX
from ..checkpoint.quant import Int8Linear, dequantize, replace_linears
from ..checkpoint.rotation import unrotate
from ..model.config import TextConfig
from ..model.export import ExportHead, ExportLinear, ExportPart
from ..model.joint_head import HeadConfig, JointHead
from ..model.precision import EXPORT_DTYPE, WEIGHT_ONLY
from ..model.qwen3_5 import DecoderLayer, RMSNorm
from ..plan import export_plan

CPU = torch.device("cpu")


def part_layers(config: TextConfig, layers_per_part: int) -> list[list[int]]:
    """The decoder's layers, `layers_per_part` to a part (the port: 8 parts of 4)."""
    count = config.num_hidden_layers
    return [list(range(first, min(first + layers_per_part, count))) for first in range(0, count, layers_per_part)]


def build_part(checkpoint: Checkpoint, config: TextConfig, layers: Sequence[int], *, final_norm: bool) -> ExportPart:
    """An `ExportPart` of `layers` (+ the final norm), filled in fp32 from the checkpoint's tensors."""
    with meta_modules():
        modules = {index: DecoderLayer(config, config.layer_types[index]) for index in layers}
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if final_norm else None
    part = ExportPart(modules, norm)
    tensors = checkpoint.tensors
    plan = export_plan(checkpoint.stored_int8)
    if checkpoint.stored_int8:
        replace_linears(part, WEIGHT_ONLY)
    fill_module(
        part,
        ((name, tensors.get(DECODER_PREFIX + name)) for name in part.state_dict()),
        dtype_of=plan.precision.dtype_of,
        device=plan.device,
    )
    if checkpoint.stored_int8:
        _dense_linears(part)
    return part.to(EXPORT_DTYPE).eval()


def _dense_linears(module: nn.Module) -> None:
    """Each `Int8Linear` becomes an `ExportLinear` holding its weight in the plain form, dequantized [O, I]."""
    for parent in list(module.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, Int8Linear):
                weight = unrotate(dequantize(child.weight, child.weight_scale)) / child.input_smoothing  # [O, I]
                setattr(parent, child_name, ExportLinear(weight.to(EXPORT_DTYPE)))


def build_head(checkpoint: Checkpoint) -> ExportHead:
    """The joint head in fp32, wrapped for export."""
    with meta_modules():
        head = JointHead(HeadConfig.from_dict(checkpoint.head_config))
    fill_module(
        head,
        ((name, checkpoint.head_tensors.get(name)) for name in head.state_dict()),
        dtype_of=export_plan(stored_int8=False).precision.head_dtype_of,
        device=CPU,
    )
    return ExportHead(head).eval()
