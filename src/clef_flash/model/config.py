"""The decoder's config, read from a release's `config.json` (a `Qwen3_5Config`, model_type qwen3_5).

`TextConfig` holds what the text decoder needs and nothing else. `from_dict` reads a `text_config` dict the
way transformers 5 does (unknown keys are ignored), `from_release_config` reads a whole release config.
Defaults are those of transformers' `Qwen3_5TextConfig()`; note that the 9B release overrides rope_theta
(1e7) and max_position_embeddings (262144): see `QWEN3_5_9B`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ModelSourceError

__all__ = ["QWEN3_5_27B", "QWEN3_5_9B", "TextConfig"]

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    # One entry per layer, "linear_attention" (Gated DeltaNet) or "full_attention" (gated attention).
    layer_types: tuple[str, ...] = ()
    full_attention_interval: int = 4
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_type: str = "default"
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    # M-RoPE layout. For text all three axes carry the same positions, so it reduces to 1-D RoPE and these
    # two are kept for the record only.
    mrope_section: tuple[int, ...] = (11, 11, 10)
    mrope_interleaved: bool = True
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    attention_bias: bool = False
    attn_output_gate: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            interval = self.full_attention_interval
            types = tuple(
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            )
            object.__setattr__(self, "layer_types", types)
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        self.validate()

    # Derived sizes ---------------------------------------------------------------------------------

    @property
    def rotary_dim(self) -> int:
        """Rotated dims at the start of each attention head (64 for the 9B)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the GDN short conv: [q | k | v]."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    # Reading -----------------------------------------------------------------------------------------

    def validate(self) -> None:
        problems = []
        if self.rope_type != "default":
            problems.append(f"rope_type {self.rope_type!r} is not supported (only 'default', no RoPE scaling)")
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"{len(self.layer_types)} layer_types for {self.num_hidden_layers} layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            problems.append(f"unknown layer types {unknown} (expected {list(LAYER_TYPES)})")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append(
                f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads {self.linear_num_key_heads}"
            )
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            problems.append(
                f"rotary dim {self.rotary_dim} (head_dim x partial_rotary_factor) must be even, in (0, head_dim]"
            )
        if self.hidden_act != "silu":
            problems.append(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.attention_bias:
            problems.append("attention_bias=True is not supported (Qwen3.5 has no biases)")
        if not self.attn_output_gate:
            problems.append("attn_output_gate=False is not supported (Qwen3.5's attention is gated)")
        if problems:
            raise ModelSourceError("unsupported decoder config: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TextConfig:
        """A `text_config` dict (transformers 5 layout, or the older top-level rope_theta / rope_scaling)."""
        rope_keys = {"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
        known = {f.name for f in dataclasses.fields(cls)} - rope_keys
        kwargs: dict[str, Any] = {key: value for key, value in d.items() if key in known and value is not None}

        # RoPE: transformers 5 keeps everything in rope_parameters; older configs have top-level rope_theta /
        # partial_rotary_factor and an optional rope_scaling dict (whose type key is "rope_type" or "type").
        rope = dict(d.get("rope_parameters") or {})
        legacy = dict(d.get("rope_scaling") or {})
        for key in ("rope_theta", "partial_rotary_factor"):
            if key not in rope and d.get(key) is not None:
                rope[key] = d[key]
        for key in ("mrope_section", "mrope_interleaved"):
            if key not in rope and key in legacy:
                rope[key] = legacy[key]
        rope_type = rope.get("rope_type") or rope.get("type") or legacy.get("rope_type") or legacy.get("type")
        if rope_type is not None:
            kwargs["rope_type"] = rope_type
        if rope.get("rope_theta") is not None:
            kwargs["rope_theta"] = float(rope["rope_theta"])
        if rope.get("partial_rotary_factor") is not None:
            kwargs["partial_rotary_factor"] = float(rope["partial_rotary_factor"])
        if rope.get("mrope_section") is not None:
            kwargs["mrope_section"] = tuple(rope["mrope_section"])
        if rope.get("mrope_interleaved") is not None:
            kwargs["mrope_interleaved"] = bool(rope["mrope_interleaved"])
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = tuple(kwargs["eos_token_id"])
        try:
            return cls(**kwargs)
        except TypeError as exc:  # a value of the wrong kind
            raise ModelSourceError(f"unreadable decoder config: {exc}") from exc

    @classmethod
    def from_release_config(cls, config: dict[str, Any]) -> TextConfig:
        """A release `config.json` (`Qwen3_5Config`): its `text_config`; a bare `qwen3_5_text` config also works."""
        model_type = config.get("model_type")
        if "text_config" in config:
            if model_type not in (None, "qwen3_5"):
                raise ModelSourceError(f"config.json has model_type {model_type!r}; expected 'qwen3_5' (Qwen3_5Config)")
            return cls.from_dict(config["text_config"] or {})
        if model_type == "qwen3_5_text":
            return cls.from_dict(config)
        raise ModelSourceError(
            f"config.json (model_type {model_type!r}) has no text_config; "
            "expected a Qwen3_5Config (model_type 'qwen3_5')"
        )


# The Qwen3.5-9B text decoder (qwen35.md §1).
QWEN3_5_9B = TextConfig(
    rope_theta=10_000_000.0, max_position_embeddings=262144, eos_token_id=248044, pad_token_id=248044
)

# The Qwen3.5-27B text decoder, base of Clef 27B: 64 layers (16 x 3 Gated DeltaNet + 1 gated attention) of width 5120,
# MLP 17408, 24 query / 4 KV heads of 256, 16 QK / 48 V DeltaNet heads of 128; the 9B's vocabulary, RoPE and special
# tokens. From the public model cards and config.json of Qwen/Qwen3.5-27B and Qwen/Qwen3.6-27B (the same decoder).
QWEN3_5_27B = dataclasses.replace(
    QWEN3_5_9B,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    layer_types=(),
    num_attention_heads=24,
    num_key_value_heads=4,
    linear_num_value_heads=48,
)
