"""The Qwen3.5 text decoder (transformers' `Qwen3_5TextModel`), formula by formula as /work/shared/qwen35.md.

Hybrid layers: Gated DeltaNet (`linear_attention`) and gated full attention (`full_attention`), each followed by
a SwiGLU MLP, pre-norm with (1+w) RMSNorms. Parameter names are exactly the checkpoint names under
`model.language_model.` (checkpoint/names.py), in the checkpoint's order, so a loader fills the model by name
and random releases are drawn from these modules (checkpoint/random_release.py):

    with torch.device("meta"):
        decoder = Qwen35Decoder(config)
    decoder.load_state_dict(tensors, assign=True, strict=True)

Dtypes follow transformers (qwen35.md §3, §9) so a bf16 model matches HF's bf16 closely: linears, conv and
embedding run in the model dtype, every norm and the delta rule in at least fp32 (`compute_dtype`: fp32, or
float64 for a float64 model), cos/sin in at least fp32 then cast to the model dtype.

Batches are right-padded: every layer is causal, so real positions never see the padding and no mask is needed;
the projections and MLPs (most of a layer's work) run on the real tokens alone.
Segmented prefill: `forward(..., state=previous, return_state=True)` continues a sequence from a `DecoderState`
(conv tails, recurrent states, attention K/V) and equals one pass over the concatenation. Rows may differ in
length, both in the state (`DecoderState.lengths`) and in the segment (`lengths`, right-padded): the pad steps
are made inert in the delta rule (beta = 0, g = 0 leave the recurrent state unchanged), each row's conv tail is
taken at its own end, and attention reads each row's own past keys.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import device_io
from .config import TextConfig
from .ops.gated_delta_rule import causal_conv1d_silu, gated_delta_rule, l2norm
from .precision import compute_dtype

__all__ = ["AttentionState", "DecoderState", "DeltaNetState", "LayerInputs", "Qwen35Decoder"]


# State carried between segments --------------------------------------------------------------------


@dataclass
class DeltaNetState:
    conv: torch.Tensor  # [B, conv_dim, K-1] the last K-1 pre-conv inputs, model dtype
    recurrent: torch.Tensor  # [B, Hv, Dk, Dv] compute dtype (fp32 / float64)


@dataclass
class AttentionState:
    key: torch.Tensor  # [B, Hkv, T, head_dim] after k_norm and RoPE; row b is real up to DecoderState.lengths[b]
    value: torch.Tensor  # [B, Hkv, T, head_dim]
    # The tensors are buffers this state alone holds, whose room past the rows' lengths the next segment may
    # fill in place (allocated once at the length the sequence will reach, instead of growing every segment).
    growable: bool = False


LayerState = DeltaNetState | AttentionState


@dataclass
class DecoderState:
    """Everything a later segment needs: the tokens seen so far by each row and each layer's state."""

    lengths: tuple[int, ...]  # [B] tokens seen, per row
    layers: list[LayerState]

    @property
    def length(self) -> int:
        """The tokens seen, when every row has seen the same number."""
        if len(set(self.lengths)) != 1:
            raise ValueError(f"rows have seen different numbers of tokens: {self.lengths}")
        return self.lengths[0]

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for layer in self.layers for tensor in _tensors(layer))

    def row(self, index: int) -> DecoderState:
        """Row `index` alone, in its own compact memory (K/V cut to its length): what a cache keeps.
        A one-row state is returned without copies (its K/V as views of their length)."""
        length = self.lengths[index]
        if len(self.lengths) == 1:
            return DecoderState(
                self.lengths,
                [
                    layer if isinstance(layer, DeltaNetState) else AttentionState(layer.key[:, :, :length], layer.value[:, :, :length])
                    for layer in self.layers
                ],
            )
        layers: list[LayerState] = []
        for layer in self.layers:
            if isinstance(layer, DeltaNetState):
                layers.append(DeltaNetState(layer.conv[index : index + 1].clone(), layer.recurrent[index : index + 1].clone()))
            else:
                layers.append(
                    AttentionState(layer.key[index : index + 1, :, :length].clone(), layer.value[index : index + 1, :, :length].clone())
                )
        return DecoderState((length,), layers)

    def select(self, rows: Sequence[int]) -> DecoderState:
        """The state of some rows, in the given order."""
        index = torch.tensor(list(rows), dtype=torch.long, device=_tensors(self.layers[0])[0].device)
        layers: list[LayerState] = []
        for layer in self.layers:
            if isinstance(layer, DeltaNetState):
                layers.append(DeltaNetState(layer.conv[index], layer.recurrent[index]))
            else:
                longest = max(self.lengths[row] for row in rows)
                layers.append(AttentionState(layer.key[index, :, :longest], layer.value[index, :, :longest]))
        return DecoderState(tuple(self.lengths[row] for row in rows), layers)

    @staticmethod
    def stack(states: Sequence[DecoderState]) -> DecoderState:
        """One batch state from single-row states (repeated objects are broadcast, not copied)."""
        lengths = tuple(length for state in states for length in state.lengths)
        if all(state is states[0] for state in states) and len(states[0].lengths) == 1:
            return DecoderState(lengths, [_expand(layer, len(states)) for layer in states[0].layers])
        longest = max(lengths)
        layers: list[LayerState] = []
        for per_row in zip(*(state.layers for state in states)):
            if isinstance(per_row[0], DeltaNetState):
                layers.append(DeltaNetState(torch.cat([s.conv for s in per_row]), torch.cat([s.recurrent for s in per_row])))
            else:
                layers.append(
                    AttentionState(_cat_padded([s.key for s in per_row], longest), _cat_padded([s.value for s in per_row], longest))
                )
        return DecoderState(lengths, layers)


def _tensors(layer: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
    return (layer.conv, layer.recurrent) if isinstance(layer, DeltaNetState) else (layer.key, layer.value)


def _expand(layer: LayerState, rows: int) -> LayerState:
    kind = type(layer)
    return kind(*(tensor.expand(rows, *tensor.shape[1:]) for tensor in _tensors(layer)))


def _cat_padded(tensors: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """[1, H, T_i, d] each -> [N, H, length, d]; what lies past a row's T_i is never read (zeros)."""
    first = tensors[0]
    out = first.new_zeros(len(tensors), first.shape[1], length, first.shape[3])
    for row, tensor in enumerate(tensors):
        out[row, :, : tensor.shape[2]] = tensor[0]
    return out


@dataclass(frozen=True)
class Rows:
    """Where each row of a segment stands: `past` tokens before it, `new` real tokens in it (then padding)."""

    past: tuple[int, ...]  # [B]
    new: tuple[int, ...]  # [B]
    width: int  # L, the padded segment length
    reserve: int = 0  # tokens the longest row will reach: the K/V room to allocate

    @property
    def same_past(self) -> bool:
        return len(set(self.past)) == 1

    @property
    def padded(self) -> bool:
        return any(count != self.width for count in self.new)


def project(linear: nn.Module, x: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """linear(x) for x [B, L, I] -> [B, L, O]. With `real` (the flat positions [N] of the real tokens of a
    right-padded batch) only those rows are multiplied and the padding reads 0: no real position reads it."""
    if real is None:
        return linear(x)
    B, L, I = x.shape
    rows = linear(x.reshape(B * L, I).index_select(0, real))  # [N, O]
    return rows.new_zeros(B * L, rows.shape[-1]).index_copy_(0, real, rows).view(B, L, -1)


# Norms -------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Qwen3_5RMSNorm: `(x_hat * (1 + w)).to(x.dtype)`, computed in at least fp32; w is an offset (init 0)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x.dtype, self.weight.dtype)
        h = x.to(dtype)
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(dtype))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Qwen3_5RMSNormGated over each value head: `(w * x_hat.to(x.dtype)) * silu(z)`, plain weight (init 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x.dtype)
        h = x.to(dtype)
        h = (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        h = self.weight * h  # the model dtype, as HF
        return (h * F.silu(gate.to(dtype))).to(x.dtype)


# RoPE ----------------------------------------------------------------------------------------------------


def rotary_cos_sin(
    config: TextConfig, start: int | Sequence[int], length: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, rotary_dim/2] for positions start..start+L-1 (text: all M-RoPE axes equal, so plain RoPE);
    with one start per row, [B, L, rotary_dim/2].

    Computed like HF (inv_freq = 1 / theta^(2j/rd) in fp32, or float64 for a float64 model) and cast to `dtype`.
    Only one half is returned: HF's cos/sin are [cos, cos] and [sin, sin].
    """
    work = compute_dtype(dtype)
    rd = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, rd, 2, dtype=work, device=device) / rd))
    steps = torch.arange(length, device=device)  # [L]
    # one start: added as a number (nothing to send up: a CUDA graph may capture this); one per row: [B, L]
    positions = (steps + start if isinstance(start, int) else torch.tensor(start, device=device)[:, None] + steps).to(work)
    angles = positions[..., None] * inv_freq  # [(B,) L, rd/2]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def mrope_cos_sin(
    config: TextConfig, positions: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, L, rotary_dim/2] for 3-D M-RoPE positions [3, B, L] (temporal, height, width): frequency j
    turns with the position of one axis, as HF's recomposition: interleaved (j % 3 = 1 height, 2 width, within
    3 x mrope_section[axis]; else temporal) or in sections. Text positions (all axes equal) give rotary_cos_sin's."""
    work = compute_dtype(dtype)
    rd = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, rd, 2, dtype=work, device=device) / rd))
    axis = torch.zeros(rd // 2, dtype=torch.long)
    if config.mrope_interleaved:
        for dim in (1, 2):
            axis[dim : 3 * config.mrope_section[dim] : 3] = dim
    else:
        bounds = [0, *itertools.accumulate(config.mrope_section)]
        for dim in (1, 2):
            axis[bounds[dim] : bounds[dim + 1]] = dim
    chosen = positions.to(device)[axis.to(device)]  # [rd/2, B, L]: each frequency's axis
    angles = chosen.permute(1, 2, 0).to(work) * inv_freq  # [B, L, rd/2]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first rotary dims of x [B, L, H, D], in place; cos, sin [L, rd/2] or [B, L, rd/2].

    Pair (i, i + rd/2): x_i' = x_i cos - x_{i+rd/2} sin, x_{i+rd/2}' = x_{i+rd/2} cos + x_i sin (HF's rotate_half,
    same roundings). Dims rd.. pass through.
    """
    half = cos.shape[-1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [(B,) L, 1, rd/2]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rotated1 = x1 * cos - x2 * sin
    rotated2 = x2 * cos + x1 * sin
    x1.copy_(rotated1)
    x2.copy_(rotated2)
    return x


# Mixers ---------------------------------------------------------------------------------------------------


class GatedAttention(nn.Module):
    """Qwen3_5Attention: per-head [q | gate] projection, (1+w) q/k norms, partial RoPE, GQA SDPA, sigmoid gate."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd = config.head_dim
        D = config.hidden_size
        self.q_proj = nn.Linear(D, self.num_heads * 2 * hd, bias=False)
        self.k_proj = nn.Linear(D, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(D, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, D, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: Rows,
        state: AttentionState | None = None,
        return_state: bool = False,
        real: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, AttentionState | None]:
        """`real`: the flat positions of a right-padded batch's real tokens (the projections skip the padding)."""
        B, L, _ = x.shape
        H, Hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        query, gate = project(self.q_proj, x, real).view(B, L, H, 2, hd).unbind(3)  # [B, L, H, hd] each; rows [q_h | gate_h]
        query = apply_rotary_(self.q_norm(query), cos, sin)  # q_norm makes a fresh tensor: rotate in place
        key = apply_rotary_(self.k_norm(project(self.k_proj, x, real).view(B, L, Hkv, hd)), cos, sin)
        value = project(self.v_proj, x, real).view(B, L, Hkv, hd)
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))  # [B, heads, L, hd]

        if rows.same_past:
            # One call for the batch: queries sit after `past` keys (bottom-right causal); a row's padding
            # comes after its real tokens, so causality keeps it away from them.
            past = rows.past[0]
            key, value, new_state = _grown(state, key, value, past, rows.reserve if return_state else 0)
            out = _attend_after(query, key, value, past)
            new_state = new_state if return_state else None
        else:
            out, new_state = self._attend_rows(query, key, value, rows, state, return_state)
        out = out.transpose(1, 2).reshape(B, L, H * hd)  # [B, L, H*hd] head-major, like the gate
        out = out * torch.sigmoid(gate).reshape(B, L, H * hd)  # the sigmoid's output is fresh: a view
        return project(self.o_proj, out, real), new_state

    @staticmethod
    def _attend_rows(query, key, value, rows: Rows, state: AttentionState, return_state: bool):
        """Rows with different pasts, one at a time: row b's n_b queries after its own past_b keys."""
        out = query.new_zeros(query.shape)  # [B, H, L, hd]; padding rows stay 0
        keys, values = [], []
        for b, (past, count) in enumerate(zip(rows.past, rows.new)):
            row_key = torch.cat((state.key[b : b + 1, :, :past], key[b : b + 1, :, :count]), dim=2)
            row_value = torch.cat((state.value[b : b + 1, :, :past], value[b : b + 1, :, :count]), dim=2)
            out[b : b + 1, :, :count] = _attend_after(query[b : b + 1, :, :count], row_key, row_value, past)
            keys.append(row_key)
            values.append(row_value)
        if not return_state:
            return out, None
        longest = max(past + count for past, count in zip(rows.past, rows.new))
        return out, AttentionState(_cat_padded(keys, longest), _cat_padded(values, longest))


# Elements of the causal mask SDPA materializes (as floats) for queries after a past: queries go in chunks
# so that it stays within this (32 MB) whatever the past; one call for 2,048 queries after 64K keys would
# materialize 0.5 GB. Each query's softmax is the same; the outputs are bitwise those of one call here.
ATTENTION_MASK_ELEMENTS = 1 << 23


def lower_right_mask(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """[queries, keys] bool: query i (at position keys - queries + i) sees keys 0 .. keys - queries + i."""
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)


def causal_lower_right(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """The causal mask of `queries` after `keys - queries` of past. On a GPU, torch's CausalBias (its SDPA picks a
    kernel that never materializes the mask); elsewhere the boolean mask CausalBias itself materializes there (the
    same SDPA call, bitwise: tests/test_gpu_path.py), so a CPU never imports torch.nn.attention.bias, which imports
    torch._dynamo (1.0 s of `import clef_flash`'s 2.4 s before issue 50)."""
    if not device_io.is_gpu(device):
        return lower_right_mask(queries, keys, device)
    from torch.nn.attention.bias import causal_lower_right as causal_bias

    return causal_bias(queries, keys)


def _attend_after(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past: int) -> torch.Tensor:
    """query [B, H, n, hd] at positions past..past+n-1; key, value [B, Hkv, past+n, hd] -> [B, H, n, hd]."""
    n = query.shape[2]
    if not past:
        return F.scaled_dot_product_attention(query, key, value, is_causal=n > 1, enable_gqa=True)
    chunk = max(1, ATTENTION_MASK_ELEMENTS // (past + n))
    if chunk >= n:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(n, past + n, query.device), enable_gqa=True)
    out = query.new_empty(query.shape)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        out[:, :, start:end] = F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, : past + end], value[:, :, : past + end],
            attn_mask=causal_lower_right(end - start, past + end, query.device), enable_gqa=True,
        )
    return out


def _grown(state: AttentionState | None, key, value, past: int, reserve: int):
    """The past `past` keys/values of every row followed by this segment's: (keys, values [B, Hkv, past+L, hd],
    the state holding them). Written in place into a growable state's room when it has enough; otherwise
    copied once into new buffers with room for `reserve` tokens."""
    length = past + key.shape[2]
    if past and state.growable and state.key.shape[2] >= length:
        state.key[:, :, past:length] = key
        state.value[:, :, past:length] = value
        return state.key[:, :, :length], state.value[:, :, :length], state
    if not past and reserve <= length:
        return key, value, AttentionState(key, value)
    buffers = []
    for past_part, new_part in ((None if not past else state.key, key), (None if not past else state.value, value)):
        buffer = new_part.new_empty(*new_part.shape[:2], max(length, reserve), new_part.shape[3])
        if past:
            buffer[:, :, :past] = past_part[:, :, :past]
        buffer[:, :, past:length] = new_part
        buffers.append(buffer)
    return buffers[0][:, :, :length], buffers[1][:, :, :length], AttentionState(*buffers, growable=reserve > length)


class ShortConv(nn.Module):
    """Holds the depthwise conv weight under the checkpoint's name `conv1d.weight` [C, 1, K]."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        nn.init.uniform_(self.weight, -(kernel**-0.5), kernel**-0.5)


class GatedDeltaNet(nn.Module):
    """Qwen3_5GatedDeltaNet: qkv projection, short conv + SiLU, gated delta rule, gated RMSNorm, out projection."""

    def __init__(self, config: TextConfig):
        super().__init__()
        D = config.hidden_size
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = config.linear_key_dim
        self.value_dim = config.linear_value_dim
        conv_dim = config.linear_conv_dim
        # Registered in the checkpoint's order (transformers' state_dict), which fixes how shards are cut.
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.conv1d = ShortConv(conv_dim, config.linear_conv_kernel_dim)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, D, bias=False)
        self.in_proj_qkv = nn.Linear(D, conv_dim, bias=False)  # channels [q | k | v], head-major
        self.in_proj_z = nn.Linear(D, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(D, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(D, self.num_v_heads, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rows: Rows,
        state: DeltaNetState | None = None,
        return_state: bool = False,
        real: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, DeltaNetState | None]:
        """`real`: the flat positions of a right-padded batch's real tokens (the projections skip the padding)."""
        B, L, _ = x.shape
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        work = compute_dtype(x.dtype)
        ends = rows.new if return_state and rows.padded else None  # where each row's conv tail is taken
        mixed, conv_tail = causal_conv1d_silu(
            project(self.in_proj_qkv, x, real), self.conv1d.weight, None if state is None else state.conv, return_state, ends
        )  # [B, L, conv_dim]
        query, key, value = mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        # l2norm and the Dk^-0.5 query scale live here, on the Hk key heads (the kernel takes q, k as given).
        query = l2norm(query.view(B, L, Hk, Dk)) * Dk**-0.5  # [B, L, Hk, Dk] compute dtype
        key = l2norm(key.view(B, L, Hk, Dk))
        value = value.view(B, L, Hv, Dv)
        beta = self.in_proj_b(x).sigmoid()  # [B, L, Hv] model dtype, as HF
        g = -self.A_log.to(work).exp() * F.softplus(self.in_proj_a(x).to(work) + self.dt_bias.to(work))  # [B, L, Hv]
        if ends is not None:  # pad steps leave the state as it is: no decay (g = 0), no write (beta = 0)
            padding = (torch.arange(L, device=x.device) >= torch.tensor(ends, device=x.device)[:, None])[..., None]
            g, beta = g.masked_fill(padding, 0.0), beta.masked_fill(padding, 0.0)
        out, recurrent = gated_delta_rule(
            query, key, value, g, beta, initial_state=None if state is None else state.recurrent
        )  # out [B, L, Hv, Dv] model dtype
        z = project(self.in_proj_z, x, real).view(B, L, Hv, Dv)
        out = self.norm(out, z).reshape(B, L, self.value_dim)
        new_state = DeltaNetState(conv_tail, recurrent) if return_state else None
        return project(self.out_proj, out, real), new_state


# The MLP's intermediate activations are 3x the hidden size, two of them live at once (and an int8 product's
# int32 result beside them): 0.3 GB for 2,048 tokens of the 9B. Its rows are independent, so more than this
# many tokens run this many at a time on a CPU (the products stay large enough to run at full rate there,
# measured; on a GPU, not measured, the MLP runs whole).
MLP_ROWS = 512


class MLP(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., D], MLP_ROWS rows at a time."""
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        if flat.shape[0] <= MLP_ROWS or not x.is_cpu:
            return self._rows(x)
        out = torch.cat([self._rows(rows) for rows in flat.split(MLP_ROWS)])  # [N, D]
        return out.view(x.shape)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate_proj(x), inplace=True)
        return self.down_proj(h.mul_(self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, rows: Rows, state=None, return_state=False, real: torch.Tensor | None = None):
        """`real`: the flat positions [N] of the real tokens of a right-padded batch; the projections and the
        MLP run on those alone (a pad position's stream is never read by a real one)."""
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h, new_state = self.linear_attn(h, rows, state, return_state, real)
        else:
            h, new_state = self.self_attn(h, cos, sin, rows, state, return_state, real)
        x = x + h
        if real is None:
            return x + self.mlp(self.post_attention_layernorm(x)), new_state
        flat = x.view(-1, x.shape[-1])
        flat.index_add_(0, real, self.mlp(self.post_attention_layernorm(flat.index_select(0, real))))
        return x, new_state


# The decoder -----------------------------------------------------------------------------------------------


@dataclass
class LayerInputs:
    """One step's input to the layers: `hidden` goes in to the first and comes out of each; the rest every
    layer reads as it is."""

    hidden: torch.Tensor  # [B, L, D] the embeddings (image features scattered in), the model dtype
    cos: torch.Tensor  # [L, rd/2], or [B, L, rd/2] (rows with different pasts, M-RoPE)
    sin: torch.Tensor
    rows: Rows
    real: torch.Tensor | None  # [N] flat positions of the real tokens of a padded batch; None: no padding

    def run(self, layer: DecoderLayer, state: LayerState | None = None, return_state: bool = False) -> LayerState | None:
        """`layer` on this step, continuing its `state`: `hidden` becomes its output; its new state is returned
        (None unless `return_state`)."""
        self.hidden, new_state = layer(self.hidden, self.cos, self.sin, self.rows, state, return_state, self.real)
        return new_state


class Qwen35Decoder(nn.Module):
    """Token ids -> last_hidden_state (after the final norm), as `Qwen3_5TextModel`."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, layer_type) for layer_type in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The activations' dtype when it differs from the embedding table's (an 8-bit model keeps a 16-bit
        # table and computes in fp32 or bf16); None: the table's dtype.
        self.activation_dtype: torch.dtype | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.activation_dtype or self.embed_tokens.weight.dtype

    def empty_state(self) -> DecoderState:
        """The state of one row before any token (zero conv tails and recurrent states, no K/V)."""
        config, device = self.config, self.embed_tokens.weight.device
        work = compute_dtype(self.dtype)
        layers: list[LayerState] = []
        for layer_type in config.layer_types:
            if layer_type == "linear_attention":
                conv = torch.zeros(1, config.linear_conv_dim, config.linear_conv_kernel_dim - 1, dtype=self.dtype, device=device)
                recurrent = torch.zeros(
                    1, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim, dtype=work, device=device
                )
                layers.append(DeltaNetState(conv, recurrent))
            else:
                empty = torch.zeros(1, config.num_key_value_heads, 0, config.head_dim, dtype=self.dtype, device=device)
                layers.append(AttentionState(empty, empty))
        return DecoderState((0,), layers)

    def state_nbytes(self, tokens: int) -> int:
        """The bytes of one row's `DecoderState` after `tokens` tokens (see state_cache.py)."""
        config = self.config
        activation, work = self.dtype.itemsize, compute_dtype(self.dtype).itemsize
        per_deltanet = (
            config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * work
            + config.linear_conv_dim * (config.linear_conv_kernel_dim - 1) * activation
        )
        per_attention_token = 2 * config.num_key_value_heads * config.head_dim * activation
        deltanet = sum(kind == "linear_attention" for kind in config.layer_types)
        return deltanet * per_deltanet + (len(config.layer_types) - deltanet) * per_attention_token * tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        lengths: torch.Tensor | Sequence[int] | None = None,
        state: DecoderState | None = None,
        return_state: bool = False,
        reserve: int = 0,
        embeds: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, DecoderState]:
        """input_ids [B, L] long, right-padded; lengths [B]: the real tokens of each row (None: all L).
        `reserve`: the tokens the longest row will reach over the coming segments (room for its K/V).

        Returns last_hidden_state [B, L, D] in the model dtype, or (it, DecoderState) with return_state.
        Positions continue from `state.lengths` when a state is given, unless `positions` [3, B, L] (M-RoPE,
        records with images) gives them; `embeds` [B, L, D] replaces the token embeddings (image features
        scattered into the pad positions). Without a state, and when no state is
        returned, `lengths` changes nothing: causality already keeps padding away from real positions.
        """
        if state is not None and len(state.lengths) != input_ids.shape[0]:
            raise ValueError(f"a state of {len(state.lengths)} rows continued by {input_ids.shape[0]} rows")
        past = None if state is None else tuple(state.lengths)
        step = self.inputs(input_ids, lengths, past=past, reserve=reserve, embeds=embeds, positions=positions)
        layer_states = [None] * len(self.layers) if state is None else state.layers
        new_states = [step.run(layer, layer_state, return_state) for layer, layer_state in zip(self.layers, layer_states)]
        x = self.norm(step.hidden)
        if return_state:
            rows = step.rows
            return x, DecoderState(tuple(p + n for p, n in zip(rows.past, rows.new)), new_states)
        return x

    def inputs(
        self,
        input_ids: torch.Tensor,
        lengths: torch.Tensor | Sequence[int] | None = None,
        *,
        past: Sequence[int] | None = None,
        reserve: int = 0,
        embeds: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> LayerInputs:
        """What every layer of a step reads, as `forward` prepares it (`past`: the tokens each row has seen
        before, None: none): the embeddings, cos/sin, the rows, the real positions."""
        B, L = input_ids.shape
        new = (L,) * B if lengths is None else tuple(int(length) for length in lengths)
        rows = Rows(past=(0,) * B if past is None else tuple(past), new=new, width=L, reserve=reserve)
        x = self.embed_tokens(input_ids).to(self.dtype) if embeds is None else embeds  # [B, L, D]
        if positions is None:
            start = rows.past[0] if rows.same_past else rows.past
            cos, sin = rotary_cos_sin(self.config, start, L, x.dtype, x.device)
        else:
            cos, sin = mrope_cos_sin(self.config, positions, x.dtype, x.device)
        real = None  # padded rows on a CPU: the projections and MLPs skip the padding (found on the host, sent up)
        if rows.padded and not device_io.is_gpu(x.device):  # a GPU runs the whole padded grid: fixed shapes
            real = (torch.arange(L) < torch.tensor(new)[:, None]).flatten().nonzero().squeeze(1).to(x.device)
        return LayerInputs(x, cos, sin, rows, real)
