"""Where each tensor of a Clef release sits (SPEC §2): the one name table beside the modules.

The decoder's and the head's tensor names are their modules' own parameter names (`model/qwen3_5.py`
under `DECODER_PREFIX`, `model/joint_head.py` as is, in the order of the checkpoint's state_dict); this
file adds what the modules do not say: where the decoder sits in `model*.safetensors`, the output
embeddings and the parts the runtime skips.
"""

from __future__ import annotations

DECODER_PREFIX = "model.language_model."  # + the decoder's parameter names
LM_HEAD = "lm_head.weight"
EMBEDDING = "embed_tokens.weight"  # relative to the decoder
VISION_PREFIX = "model.visual."  # the vision tower: loaded on its own (loading.build_vision), skipped by the decoder's loader
MTP_PREFIX = "mtp."  # the multi-token-prediction layers (as vLLM reads them): skipped too
IGNORED_PREFIXES = (VISION_PREFIX, MTP_PREFIX)

