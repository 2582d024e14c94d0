"""Random Clef releases in the exact layout of `Cloudflare/clef-flash` (SPEC §2): the offline `tiny`, tests, benchmarks.

No weights can be downloaded, so tests build releases with random weights that look like the real one
file for file, key for key and shape for shape:

    config.json                      Qwen3_5Config as transformers 5.23.0 writes it (+ "clef_flash_random")
    model.safetensors                bf16 decoder, lm_head, a small vision tower, mtp.* (ignored by HF)
      or model-0000k-of-0000N.safetensors + model.safetensors.index.json   (max_shard_bytes)
    joint_head.safetensors           the joint schema head, fp32, keys of the reference JointSchemaHead
    joint_head_config.json           hidden_size, width, routing_layers, layers, heads, feedforward
    tokenizer.json, tokenizer_config.json   the real Qwen3.5 vocabulary (checkpoint/vocab.py)
    preprocessor_config.json, video_preprocessor_config.json   the image and video processors (Qwen3-VL's)
    RANDOM_RELEASE.md                says the weights are random

The tensor table (names, shapes, how each tensor is drawn) is not written here: `tensor_table` /
`head_tensor_table` build the runtime's own modules (`Qwen35Decoder`, `JointHead`, `VisionTower`; `mtp.*`, which
the runtime does not read, as a small mirror) on the meta device from the config, walk their state_dict and draw
each tensor by init rules keyed by its leaf name; tests check the table against transformers and the
reference head.
Tensors are streamed to disk in chunks, so even the full 9B (~19 GB) is written in bounded memory.
Every tensor has its own generator, seeded from (seed, tensor name): the contents do not depend on
sharding or order, and the same seed gives byte-identical files (for one torch version).

Scales keep activations O(1) through any depth: projections that read a normalised input are
N(0, 1/fan_in); projections that write into the residual stream are further divided by sqrt(2·layers);
(1+w) RMSNorm offsets are N(0, 0.1); the gated DeltaNet norm is 1 + N(0, 0.1); A_log = log U(1, 16) and
dt_bias is the inverse softplus of a log-uniform dt in [1e-3, 1e-1] (Mamba's rule), so the linear
attention decays over tens of tokens instead of forgetting at once.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ..model.config import QWEN3_5_27B, QWEN3_5_9B, TextConfig
from ..model.joint_head import HeadConfig, JointHead
from ..model.precision import BF16, FP16, FP32, FP64
from ..model.qwen3_5 import DecoderLayer, GatedRMSNorm, Qwen35Decoder, RMSNorm
from ..model.vision import VisionConfig, VisionTower
from .names import DECODER_PREFIX, LM_HEAD, MTP_PREFIX, VISION_PREFIX
from .safetensors_io import PlannedTensor, write_safetensors
from .vocab import BUILDER_VERSION as VOCAB_BUILDER_VERSION
from .vocab import VOCAB_ROWS, write_tokenizer_files
from .vocab import cache_dir as default_cache_dir

#: Bump when the bytes of a generated release change; cached releases are rebuilt.
RELEASE_BUILDER_VERSION = "1"
#: The transformers version whose `save_pretrained` output the files reproduce.
TRANSFORMERS_LAYOUT_VERSION = "5.23.0"

# Real Qwen3.5 special-token ids (SPEC §2; tests check them against the vocabulary).
VISION_START_ID = 248053
VISION_END_ID = 248054
IMAGE_PAD_ID = 248056
VIDEO_PAD_ID = 248057

Progress = Callable[[int, int], None]  # (bytes written so far, total bytes)


# ---------------------------------------------------------------------------------------------
# Configs


# A random release's vision tower: deliberately small (what the tests' images and videos need); 64 position
# embeddings make a square 8 x 8 grid.
SMALL_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "num_position_embeddings": 64}


def small_vision(text: TextConfig, **sizes: int) -> VisionConfig:
    """The runtime's `VisionConfig` (model/vision.py) of a small tower (`SMALL_VISION`, with `sizes`) feeding `text`."""
    return VisionConfig(**{**SMALL_VISION, **sizes}, out_hidden_size=text.hidden_size)


@dataclass(frozen=True)
class RandomConfig:
    """A random release: the decoder (`text_config`, the runtime's `TextConfig`), the joint head
    (`joint_head_config.json`, the runtime's `HeadConfig`) and a vision tower (the runtime's `VisionConfig`; None:
    `small_vision`). `mtp_layers` is
    config.json's `mtp_num_hidden_layers`, which the runtime's `TextConfig` does not read."""

    name: str
    text: TextConfig
    head: HeadConfig
    vision: VisionConfig | None = None
    mtp_layers: int = 1
    # Activation outliers as trained LLMs have them (LLM.int8(), SmoothQuant): `outlier_channels` hidden
    # channels scaled by `outlier_gain` through every layer's two (1+w) RMSNorm weights, so those channels
    # of every projection's input are `outlier_gain` times the rest. 0: none.
    outlier_channels: int = 0
    outlier_gain: float = 1.0

    def __post_init__(self) -> None:
        if self.vision is None:
            object.__setattr__(self, "vision", small_vision(self.text))  # frozen: filled once, here
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ValueError(f"random config {self.name!r}: the vision tower feeds {self.vision.out_hidden_size}, not the decoder's {self.text.hidden_size}")
        if self.head.hidden_size != self.text.hidden_size:
            raise ValueError(
                f"random config {self.name!r}: the head's hidden_size {self.head.hidden_size} is not "
                f"the decoder's {self.text.hidden_size}"
            )
        if self.text.tie_word_embeddings:
            raise ValueError(f"random config {self.name!r}: random releases have a separate lm_head (untied)")

    def head_config(self) -> dict[str, int]:
        """The contents of `joint_head_config.json`: the reference `JointSchemaHead(**config)`."""
        return asdict(self.head)


def _text(**sizes: int) -> TextConfig:
    """The Qwen3.5-9B decoder (`QWEN3_5_9B`: real vocabulary, special tokens and RoPE) with other sizes;
    layer_types are derived again from the new depth."""
    return replace(QWEN3_5_9B, vocab_size=VOCAB_ROWS, layer_types=(), **sizes)


_TINY_VISION_TEXT = _text(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16,
)
#: The reference clef-flash head (`joint_head_config.json` of the real release).
_REAL_HEAD = HeadConfig(hidden_size=4096, width=1024, routing_layers=2, layers=4, heads=16, feedforward=4096)
#: Clef 27B's head: its hidden_size is the decoder's 5120; the rest is clef-flash's (Cloudflare's Clef 27B
#: joint_head_config.json was not found in public: an assumption, one line to change when it is).
_HEAD_27B = replace(_REAL_HEAD, hidden_size=5120)

RANDOM_CONFIGS: dict[str, RandomConfig] = {
    # Everything small; the real vocabulary (248,320 embedding rows) is kept in every config.
    "tiny": RandomConfig(
        "tiny",
        _text(
            hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16,
        ),
        HeadConfig(hidden_size=64, width=32, routing_layers=2, layers=2, heads=4, feedforward=64),
    ),
    # tiny with a 2-block vision tower and 4 rotary frequencies (head_dim 32): every M-RoPE axis turns
    # (tiny's 2 frequencies leave the width axis out). The vision parity tests use it.
    "tiny-vision": RandomConfig(
        "tiny-vision",
        _TINY_VISION_TEXT,
        HeadConfig(hidden_size=64, width=32, routing_layers=2, layers=2, heads=4, feedforward=64),
        vision=small_vision(_TINY_VISION_TEXT, depth=2),
    ),
    # The 9B per-head sizes (head_dim 256, 16/4 attention heads, 16/32 DeltaNet heads of 128) on a
    # narrow residual stream, 4 layers: exercises the real kernel shapes at a fraction of the cost.
    "9b-heads": RandomConfig(
        "9b-heads",
        _text(num_hidden_layers=4, hidden_size=256, intermediate_size=512),
        HeadConfig(hidden_size=256, width=64, routing_layers=2, layers=2, heads=4, feedforward=128),
    ),
    # 9b-heads with activation outliers: 3 hidden channels 50x the rest at every projection's input.
    "9b-heads-outliers": RandomConfig(
        "9b-heads-outliers",
        _text(num_hidden_layers=4, hidden_size=256, intermediate_size=512),
        HeadConfig(hidden_size=256, width=64, routing_layers=2, layers=2, heads=4, feedforward=128),
        outlier_channels=3,
        outlier_gain=50.0,
    ),
    # The 9B per-head sizes on a 1024-wide residual stream (MLP 3072, the 9B's 3x), 4 layers, the real head at 1024:
    # the int8 schemes' rotation and groups at a wider input than 9b-heads' 256, at a tenth of the 9b-part's cost
    # (benchmarks/agreement.py --yardsticks).
    "9b-heads-1024": RandomConfig(
        "9b-heads-1024",
        _text(num_hidden_layers=4, hidden_size=1024, intermediate_size=3072),
        replace(_REAL_HEAD, hidden_size=1024),
    ),
    # Full 9B layer sizes, 4 layers (one 3×DeltaNet + attention block; ~5.8 GB of bf16), the real head.
    "9b-part": RandomConfig("9b-part", _text(num_hidden_layers=4), _REAL_HEAD),
    # The full Qwen3.5-9B (qwen35.md §1, ~19 GB of bf16), the real head.
    "9b": RandomConfig("9b", QWEN3_5_9B, _REAL_HEAD),
    # Clef 27B's widths (QWEN3_5_27B), 2 layers: one Gated DeltaNet and one gated attention layer (~6.6 GB of bf16,
    # 5.1 of them the two embedding tables), the head at width 5120.
    "27b-part": RandomConfig(
        "27b-part", replace(QWEN3_5_27B, num_hidden_layers=2, layer_types=("linear_attention", "full_attention")), _HEAD_27B
    ),
    # The full Qwen3.5-27B decoder (~54 GB of bf16) and head: for its plan and tensor table (shapes); never written by tests.
    "27b": RandomConfig("27b", QWEN3_5_27B, _HEAD_27B),
}


def resolve_config(config: str | RandomConfig) -> RandomConfig:
    if isinstance(config, RandomConfig):
        return config
    try:
        return RANDOM_CONFIGS[config]
    except KeyError:
        raise ValueError(
            f"unknown random config {config!r}; choose one of {sorted(RANDOM_CONFIGS)} or pass a RandomConfig"
        ) from None


_DTYPE_NAMES = {BF16: "bfloat16", FP16: "float16", FP32: "float32"}


# TextConfig's fields are transformers' own names; these it keeps elsewhere (rope_parameters) or does not save.
_ROPE_FIELDS = ("mrope_interleaved", "mrope_section", "partial_rotary_factor", "rope_theta", "rope_type")
_UNSAVED_FIELDS = ("attn_output_gate", "full_attention_interval")


def release_config(
    config: RandomConfig, *, seed: int = 0, dtype: torch.dtype = BF16, mtp: bool = True
) -> dict:
    """`config.json`: the fields `Qwen3_5ForConditionalGeneration.save_pretrained` writes, plus
    `clef_flash_random` (so tools can label outputs as random) and `mtp_num_hidden_layers`.
    Its `text_config` reads back as `config.text` (`TextConfig.from_release_config`)."""
    text, vision = config.text, config.vision
    fields = asdict(text)
    rope = {name: fields.pop(name) for name in _ROPE_FIELDS}
    for name in _UNSAVED_FIELDS:
        del fields[name]
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "clef_flash_random": {"config": config.name, "seed": seed},
        "dtype": _DTYPE_NAMES[dtype],
        "image_token_id": IMAGE_PAD_ID,
        "model_type": "qwen3_5",
        "text_config": {
            **fields,
            "attention_dropout": 0.0,
            "bos_token_id": None,
            "initializer_range": 0.02,
            "layer_types": list(text.layer_types),
            "model_type": "qwen3_5_text",
            "mtp_num_hidden_layers": config.mtp_layers if mtp else 0,
            "rope_parameters": {**rope, "mrope_section": list(text.mrope_section)},
            "use_cache": True,
        },
        "tie_word_embeddings": False,
        "transformers_version": TRANSFORMERS_LAYOUT_VERSION,
        "video_token_id": VIDEO_PAD_ID,
        "vision_config": {
            **{name: value for name, value in asdict(vision).items() if name != "rope_theta"},  # out_hidden_size: the decoder's
            "initializer_range": 0.02,
            "model_type": "qwen3_5_vision",
            "rope_parameters": {"rope_theta": vision.rope_theta, "rope_type": "axial"},
        },
        "vision_end_token_id": VISION_END_ID,
        "vision_start_token_id": VISION_START_ID,
    }


# ---------------------------------------------------------------------------------------------
# The tensor table: the runtime's modules, built on the meta device, give every name and shape


@dataclass(frozen=True)
class Init:
    """How a tensor is drawn. kind: normal(a=mean, b=std), log_uniform (log U(a, b)),
    dt_bias (inverse softplus of a log-uniform dt in [a, b]), constant (a), or norm_outliers (a (1+w)
    norm offset N(0, a) whose c evenly spaced channels are b - 1, so that (1+w) scales them by b)."""

    kind: str
    a: float = 0.0
    b: float = 0.0
    c: int = 0

    @staticmethod
    def normal(std: float, mean: float = 0.0) -> Init:
        return Init("normal", mean, std)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: Init

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


NORM_OFFSET = Init.normal(0.1)  # (1+w) RMSNorm: w near 0
UNIT_NORM = Init.normal(0.1, mean=1.0)  # plain-weight norms (LayerNorm, gated RMSNorm): near 1
BIAS = Init.normal(0.02)

# Non-zero head scalars (zeros, the reference's init, would switch the joint path off), small
# enough that random answers are not saturated: gate sigmoid(0.5) = 0.62, joint scale e^1, prior e^-0.5.
HEAD_SCALARS = {"prior_logit_scale": -0.5, "joint_logit_scale": 1.0, "residual_gate": 0.5}

# Init rules keyed by a parameter's leaf name (its own name, or its module's), first match wins; what
# none names is drawn by its module's kind (`_init`): a bias, a norm, or N(0, gain²/fan_in).
PARAMETER_INITS = {
    "dt_bias": Init("dt_bias", 1e-3, 1e-1),
    "A_log": Init("log_uniform", 1.0, 16.0),
    **{name: Init("constant", value) for name, value in HEAD_SCALARS.items()},
}
MODULE_INITS = {
    # Unit-variance input embeddings: the residual stream starts O(1), like the layers' outputs.
    "embed_tokens": Init.normal(1.0),
    # Its input is a mean of lm_head rows (rms 1/sqrt(D)): unit std keeps it O(1).
    "option_lexical_projection": Init.normal(1.0),
    "type_embedding": Init.normal(1.0),
    "pos_embed": Init.normal(0.02),
}
# Projections that write into the residual stream: N(0, 1/fan_in) further divided by sqrt(2·layers).
RESIDUAL_WRITERS = ("o_proj", "out_proj", "down_proj")
# The decoder layers' two (1+w) norms, which carry a config's activation outliers.
OUTLIER_NORMS = ("input_layernorm", "post_attention_layernorm")


def _init(name: str, kind: type[nn.Module], shape: tuple[int, ...], *, residual_gain: float, layer_norm: Init) -> Init:
    """How the tensor `name` (its module a `kind`) is drawn."""
    *path, leaf = name.split(".")
    owner = path[-1] if path else ""
    if leaf in PARAMETER_INITS:
        return PARAMETER_INITS[leaf]
    if owner in MODULE_INITS:
        return MODULE_INITS[owner]
    if leaf.endswith("bias"):
        return BIAS
    if issubclass(kind, RMSNorm):
        return layer_norm if owner in OUTLIER_NORMS else NORM_OFFSET
    if issubclass(kind, (GatedRMSNorm, nn.LayerNorm)):
        return UNIT_NORM
    gain = residual_gain if owner in RESIDUAL_WRITERS else 1.0
    return Init.normal(gain / math.sqrt(math.prod(shape[1:])))  # fan_in: every input of one output


def _module_table(
    module: nn.Module, prefix: str = "", *, residual_gain: float = 1.0, layer_norm: Init = NORM_OFFSET
) -> list[TensorSpec]:
    """Every tensor of a meta-built module, named `prefix` + its state_dict name, in state_dict order
    (a module's own parameters and buffers, then its children's)."""
    specs = []
    for module_name, owner in module.named_modules():
        for leaf, tensor in [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]:
            name, shape = prefix + (f"{module_name}.{leaf}" if module_name else leaf), tuple(tensor.shape)
            specs.append(TensorSpec(name, shape, _init(name, type(owner), shape, residual_gain=residual_gain, layer_norm=layer_norm)))
    return specs


class _MultiTokenPrediction(nn.Module):
    """Qwen3.5's multi-token-prediction block under `mtp.` (as vLLM reads it; transformers ignores it)."""

    def __init__(self, text: TextConfig, layers: int):
        super().__init__()
        d = text.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(text, "full_attention") for _ in range(layers))
        self.norm = RMSNorm(d, text.rms_norm_eps)
        self.pre_fc_norm_embedding = RMSNorm(d, text.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(d, text.rms_norm_eps)


def tensor_table(config: str | RandomConfig, *, mtp: bool = True) -> list[TensorSpec]:
    """Every tensor of `model*.safetensors`, in the order of transformers'
    `Qwen3_5ForConditionalGeneration.state_dict()` (which fixes how shards are cut), then `mtp.*`."""
    config = resolve_config(config)
    text = config.text
    # Each layer adds two residual branches; 1/sqrt(2·layers) keeps the stream O(1) at any depth.
    residual_gain = 1 / math.sqrt(2 * text.num_hidden_layers)
    layer_norm = NORM_OFFSET
    if config.outlier_channels:
        layer_norm = Init("norm_outliers", NORM_OFFSET.b, config.outlier_gain, config.outlier_channels)
    with torch.device("meta"):
        vision = VisionTower(config.vision)
        decoder = Qwen35Decoder(text)
        lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        multi_token = _MultiTokenPrediction(text, config.mtp_layers) if mtp else None
    # Output embeddings N(0, 1/D): logits of a unit hidden state are O(1); the head reads these rows raw.
    specs = _module_table(vision, VISION_PREFIX)
    specs += _module_table(decoder, DECODER_PREFIX, residual_gain=residual_gain, layer_norm=layer_norm)
    specs += _module_table(lm_head, LM_HEAD.removesuffix("weight"))
    if multi_token is not None:
        specs += _module_table(multi_token, MTP_PREFIX, residual_gain=residual_gain)
    return specs


def head_tensor_table(config: str | RandomConfig) -> list[TensorSpec]:
    """Every tensor of `joint_head.safetensors`, named and ordered as the reference
    `JointSchemaHead(**config).state_dict()` (SPEC §5): the runtime's `JointHead`, which loads it strictly."""
    config = resolve_config(config)
    with torch.device("meta"):
        head = JointHead(config.head)
    return _module_table(head)


# ---------------------------------------------------------------------------------------------
# Drawing tensors

_CHUNK_ELEMENTS = 1 << 23  # 32 MiB of fp32 per draw: memory stays bounded for any tensor size


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"clef-flash-random/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def draw_chunks(spec: TensorSpec, seed: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The flattened tensor, in chunks of at most `_CHUNK_ELEMENTS`, cast to `dtype`."""
    generator = torch.Generator().manual_seed(_tensor_seed(seed, spec.name))
    init = spec.init
    for start in range(0, spec.numel, _CHUNK_ELEMENTS):
        count = min(_CHUNK_ELEMENTS, spec.numel - start)
        if init.kind == "normal":
            values = torch.randn(count, generator=generator).mul_(init.b).add_(init.a)
        elif init.kind == "log_uniform":
            values = torch.rand(count, generator=generator).mul_(init.b - init.a).add_(init.a).log_()
        elif init.kind == "dt_bias":
            low, high = math.log(init.a), math.log(init.b)
            dt = torch.rand(count, generator=generator, dtype=FP64).mul_(high - low).add_(low).exp_()
            values = (dt + torch.log(-torch.expm1(-dt))).float()  # softplus(dt_bias) == dt
        elif init.kind == "norm_outliers":
            values = torch.randn(count, generator=generator).mul_(init.a)
            values[outlier_channels(spec.numel, init.c)] = init.b - 1.0  # a norm is one chunk: start == 0
        elif init.kind == "constant":
            values = torch.full((count,), init.a)
        else:
            raise ValueError(f"unknown init kind {init.kind!r} for {spec.name}")
        yield values.to(dtype)


def outlier_channels(width: int, count: int) -> list[int]:
    """The channels a norm_outliers init scales: `count` of `width`, evenly spaced, none at the edges."""
    return [int((index + 0.5) * width / count) for index in range(count)]


def draw_tensor(spec: TensorSpec, seed: int = 0, dtype: torch.dtype = FP32) -> torch.Tensor:
    """One tensor exactly as the release holds it (for tests and small configs)."""
    return torch.cat(list(draw_chunks(spec, seed, dtype))).reshape(spec.shape)


class RandomTensors:
    """The tensors of a random release, drawn on demand instead of read from files: the same
    `keys / shape / dtype / get` as `safetensors_io.SafetensorsFiles`, and the same values as the files that
    `write_random_release` writes for the seed and dtype (each tensor has its own generator)."""

    def __init__(self, specs: Sequence[TensorSpec], *, seed: int, dtype: torch.dtype):
        self._specs = {spec.name: spec for spec in specs}
        self.seed = seed
        self.stored_dtype = dtype

    @classmethod
    def of_model(cls, config: str | RandomConfig, *, seed: int = 0, dtype: torch.dtype = BF16) -> RandomTensors:
        """`model*.safetensors` (bf16, as `write_random_release` writes it by default)."""
        return cls(tensor_table(config), seed=seed, dtype=dtype)

    @classmethod
    def of_head(cls, config: str | RandomConfig, *, seed: int = 0, dtype: torch.dtype = FP32) -> RandomTensors:
        """`joint_head.safetensors` (fp32)."""
        return cls(head_tensor_table(config), seed=seed, dtype=dtype)

    def keys(self) -> set[str]:
        return set(self._specs)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._specs[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self.stored_dtype

    def get(self, name: str) -> torch.Tensor:
        return draw_tensor(self._specs[name], self.seed, self.stored_dtype)


def _write_safetensors(
    path: Path,
    specs: Sequence[TensorSpec],
    *,
    seed: int,
    dtype: torch.dtype,
    metadata: dict[str, str] | None,
    on_bytes: Callable[[int], None],
) -> None:
    """Byte for byte what `safetensors.torch.save_file` writes, each tensor drawn in chunks as it is written."""
    by_name = {spec.name: spec for spec in specs}
    write_safetensors(
        path,
        [PlannedTensor(spec.name, dtype, spec.shape) for spec in specs],
        lambda planned: draw_chunks(by_name[planned.name], seed, dtype),
        metadata=metadata,
        on_bytes=on_bytes,
        durable=False,
    )


def plan_shards(specs: Sequence[TensorSpec], itemsize: int, max_shard_bytes: int | None) -> dict[str, list[TensorSpec]]:
    """File name -> tensors, cut as huggingface_hub's `split_torch_state_dict_into_shards` cuts
    (what `save_pretrained(max_shard_size=...)` uses): tensors in order fill the current shard until
    the next would overflow it; a tensor larger than the limit gets a shard of its own, numbered first."""
    if max_shard_bytes is None:
        return {"model.safetensors": list(specs)}
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    current_bytes = 0
    for spec in specs:
        size = spec.numel * itemsize
        if size > max_shard_bytes:
            shards.append([spec])
            continue
        if current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(spec)
        current_bytes += size
    if current:
        shards.append(current)
    if len(shards) == 1:
        return {"model.safetensors": shards[0]}
    count = len(shards)
    return {f"model-{index + 1:05d}-of-{count:05d}.safetensors": shard for index, shard in enumerate(shards)}


# ---------------------------------------------------------------------------------------------
# Releases

RANDOM_RELEASE_NOTE = """\
# Random clef-flash release

Generated by `clef_flash.checkpoint.random_release` (builder v{version}) from the random config
`{name}` with seed {seed}. The layout, key names and shapes are those of `Cloudflare/clef-flash`;
**every weight is random**, so no decision, probability or benchmark quality number from this
directory means anything. Use it for tests, parity checks and speed measurements only.
`config.json` carries `"clef_flash_random": {{"config": "{name}", "seed": {seed}}}` so that tools can say so.
"""


def write_random_release(
    out_dir: str | os.PathLike[str],
    config: str | RandomConfig = "tiny",
    *,
    seed: int = 0,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype = BF16,
    head_dtype: torch.dtype = FP32,
    mtp: bool = True,
    progress: Progress | None = None,
) -> Path:
    """Write a random release of `config` (a name in RANDOM_CONFIGS or a RandomConfig) into `out_dir`
    (created; it must be empty). `max_shard_bytes` shards `model*.safetensors` as `save_pretrained`
    would; `mtp` adds the `mtp.*` tensors; `progress(done, total)` is called as bytes are written."""
    config = resolve_config(config)
    if dtype not in _DTYPE_NAMES or head_dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype and head_dtype must be one of {sorted(map(str, _DTYPE_NAMES))}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; a random release is written into an empty directory")

    specs = tensor_table(config, mtp=mtp)
    head_specs = head_tensor_table(config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    head_itemsize = torch.empty((), dtype=head_dtype).element_size()
    total = sum(s.numel for s in specs) * itemsize + sum(s.numel for s in head_specs) * head_itemsize
    done = 0

    def on_bytes(count: int) -> None:
        nonlocal done
        done += count
        if progress is not None:
            progress(done, total)

    shards = plan_shards(specs, itemsize, max_shard_bytes)
    for filename, shard in shards.items():  # one file open at a time, streamed
        _write_safetensors(out / filename, shard, seed=seed, dtype=dtype, metadata={"format": "pt"}, on_bytes=on_bytes)
    if len(shards) > 1:
        index = {
            "metadata": {
                "total_parameters": sum(s.numel for s in specs),
                "total_size": sum(s.numel for s in specs) * itemsize,
            },
            "weight_map": {spec.name: filename for filename, shard in shards.items() for spec in shard},
        }
        write_release_json(out / "model.safetensors.index.json", index)
    # The reference exporter (clef-finetune) saves the head without safetensors metadata.
    _write_safetensors(
        out / "joint_head.safetensors", head_specs, seed=seed, dtype=head_dtype, metadata=None, on_bytes=on_bytes
    )
    write_release_json(out / "joint_head_config.json", config.head_config())
    write_release_json(out / "config.json", release_config(config, seed=seed, dtype=dtype, mtp=mtp))
    write_tokenizer_files(out)
    for name, processor in processor_configs().items():
        write_release_json(out / name, processor)
    (out / "RANDOM_RELEASE.md").write_text(
        RANDOM_RELEASE_NOTE.format(version=RELEASE_BUILDER_VERSION, name=config.name, seed=seed)
    )
    return out


def processor_configs() -> dict[str, dict]:
    """`preprocessor_config.json` and `video_preprocessor_config.json` as Qwen3.5 releases ship them (Qwen3-VL's
    processors: patch 16, temporal patch 2, merge 2, mean = std = 0.5; images from 256x256 to 16 MP)."""
    shared = {
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "merge_size": 2,
        "patch_size": 16,
        "processor_class": "Qwen3VLProcessor",
        "temporal_patch_size": 2,
    }
    image = {**shared, "image_processor_type": "Qwen2VLImageProcessorFast", "size": {"longest_edge": 16777216, "shortest_edge": 65536}}
    video = {
        **shared,
        "do_sample_frames": True,
        "fps": 2,
        "max_frames": 768,
        "min_frames": 4,
        "size": {"longest_edge": 25165824, "shortest_edge": 4096},
        "video_processor_type": "Qwen3VLVideoProcessor",
    }
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video}


def write_release_json(path: Path, value: object) -> None:
    """A release's JSON file, as transformers writes config.json and the shard index (a bundle converted from
    `random:NAME` copies its configs with this too: byte for byte those of the written release)."""
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _add_processor_configs(path: Path) -> None:
    """A cached release written before the processor configs were part of the layout gains them (the weights
    and every other file are unchanged, so the builder version stays and other checkouts keep the cache)."""
    for name, processor in processor_configs().items():
        if not (path / name).is_file():
            staging = path / f".{name}.{os.getpid()}"
            write_release_json(staging, processor)
            os.replace(staging, path / name)


def _release_version() -> str:
    return f"{RELEASE_BUILDER_VERSION}.{VOCAB_BUILDER_VERSION}"


def tiny_release(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cached `tiny` release (seed 0) that `clef_flash.load("tiny")` and the tests use.

    Lives under `cache_dir` (default `$CLEF_FLASH_CACHE` or `~/.cache/clef-flash`) in a directory
    named after the builder version; built once, atomically (into a temporary directory, then
    renamed), and rebuilt when the version changes. Releases of older versions are removed."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = f"release-tiny-v{_release_version()}"
    path = root / name
    if (path / "config.json").is_file():
        _add_processor_configs(path)
        return path
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        write_random_release(staging, "tiny", seed=0)
        try:
            os.rename(staging, path)
        except OSError:
            if not (path / "config.json").is_file():  # lost a race to another builder: theirs is as good
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for stale in root.glob("release-tiny-v*"):
        if stale.name != name and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return path
