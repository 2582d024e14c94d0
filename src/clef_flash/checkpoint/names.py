"""Where each tensor of a Clef release sits (SPEC §2): the one name table beside the modules.

The decoder's and the head's tensor names are their modules' own parameter names (`model/qwen3_5.py`
under `DECODER_PREFIX`, `model/joint_head.py` as is, in the order of the checkpoint's state_dict); this
file adds what the modules do not say: where the decoder sits in `model*.safetensors`, the output
embeddings, the parts the runtime skips, and the names a calibrated bundle adds beside a projection.
"""

from __future__ import annotations

from ..model.precision import OUTLIER_CHANNELS
from .safetensors_io import TensorSource

DECODER_PREFIX = "model.language_model."  # + the decoder's parameter names
LM_HEAD = "lm_head.weight"
EMBEDDING = "embed_tokens.weight"  # relative to the decoder
VISION_PREFIX = "model.visual."  # the vision tower: loaded on its own (loading.build_vision), skipped by the decoder's loader
MTP_PREFIX = "mtp."  # the multi-token-prediction layers (as vLLM reads them): skipped too
IGNORED_PREFIXES = (VISION_PREFIX, MTP_PREFIX)


def outlier_counts(tensors: TensorSource) -> dict[str, int]:
    """Decoder linear name (relative to the decoder) -> how many outlier input channels a calibrated
    bundle keeps apart for it, read from the `<linear>.outlier_channels` [n] tensors."""
    suffix = "." + OUTLIER_CHANNELS
    return {
        name[len(DECODER_PREFIX) : -len(suffix)]: tensors.shape(name)[0]
        for name in tensors.keys()
        if name.startswith(DECODER_PREFIX) and name.endswith(suffix)
    }
