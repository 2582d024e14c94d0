"""Test support: the real Qwen3.5 vocabulary and random releases in the release layout.

`TextConfig` and `HeadConfig` are the runtime's own (`clef_flash.model`), re-exported for building a
`RandomConfig`."""

from ..model.config import TextConfig
from ..model.joint_head import HeadConfig
from .release import (
    RANDOM_CONFIGS,
    RandomConfig,
    RandomTensors,
    TensorSpec,
    VisionConfig,
    head_tensor_table,
    random_model,
    release_config,
    tensor_table,
    tiny_release,
    write_random_release,
)
from .vocab import VOCAB_ROWS, write_tokenizer_files

__all__ = [
    "RANDOM_CONFIGS",
    "VOCAB_ROWS",
    "HeadConfig",
    "RandomConfig",
    "RandomTensors",
    "TensorSpec",
    "TextConfig",
    "VisionConfig",
    "head_tensor_table",
    "random_model",
    "release_config",
    "tensor_table",
    "tiny_release",
    "write_random_release",
    "write_tokenizer_files",
]
