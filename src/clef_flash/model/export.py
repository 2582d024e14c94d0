"""Export twins: the decoder's layers and the joint head in ops Core ML converts, with the port's inputs.

Twins of `qwen3_5.Qwen35Decoder` and `joint_head.JointHead` (tests/test_coreml.py holds them together). They
hold the very same modules (`DecoderLayer`, `JointHead`; parameter names unchanged) and differ only in how
they compute, for `torch.jit.trace` and coremltools:

* `ExportPart`: a run of decoder layers (the last part also applies the final norm). Inputs
  `hidden [1, L, D]`, `cos [L, rd]`, `sin [L, rd]` (rd = the rotary dims, `[cos, cos]` as HF); output
  `[1, L, D]`. Right padding needs no mask: every layer is causal. No in-place ops; the Gated DeltaNet is
  `static_chunk_gated_delta_rule`; norms divide by the row's absmax first, so that squares stay inside fp16
  (the residual stream reaches |x| ~ 2.7e3, and 2.7e3^2 overflows fp16's 65504).
* `ExportHead`: the head at a fixed shape, from host-built matrices instead of index tensors:
  `states [L, D]` (the final hidden states, zero past the record), `mem_mask [L]` (0, or MASKED past the last
  real token), `last [L]` (one-hot), `q_mean [Q, L]`, `o_mean [O, L]` (1/|span| over each span), `o2q [O, Q]`
  (one-hot owner), `lexical [O, D]` (mean output-embedding rows of each option), `type_oh [Q, 3]`,
  `q_mask [Q]`, `o_mask [O]` (0 or MASKED); output `logits [O]` (MASKED-shifted at padding).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import TextConfig
from .joint_head import LOG_MAX_LOGIT_SCALE, JointHead
from .ops.static_delta_rule import static_chunk_gated_delta_rule, static_shape
from .qwen3_5 import DecoderLayer, GatedAttention, GatedDeltaNet, RMSNorm, rotary_cos_sin

MASKED = -1.0e4  # the additive mask value of the head's inputs (the port's): exp() of it is 0
NORM_FLOOR = 1.0e-3  # absmax floor of the overflow-safe norms: eps / floor^2 stays inside fp16
# The op families of a part whose compute precision is chosen apart (model/precision.py, COREML_FP32_FAMILIES):
# the projections, the delta rule (its gates, decays and chunked core), attention (RoPE, mask, softmax, gate),
# the norms (RMS, q/k, l2, final) and, apart from them, the DeltaNet's gated RMSNorm, which reads the delta
# rule's small outputs. The ops outside them (conv taps, SiLU, residual adds) compute in the part's dtype.
FAMILIES = ("projections", "delta_rule", "attention", "norms", "gated_norm")
REGIONS = "regions"  # ExportPart's ModuleDict of `Region`s: the scope prefix their ops carry into Core ML


def rotary_tables(config: TextConfig, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [L, rd] for positions 0..L-1: our `rotary_cos_sin` halves, doubled (HF's [cos, cos])."""
    cos, sin = rotary_cos_sin(config, 0, length, dtype, torch.device("cpu"))
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def _safe_rsqrt_scaled(x: Tensor, eps: float, mean: bool) -> Tensor:
    """x * rsqrt(mean-or-sum(x^2) + eps) over the last dim, with x divided by its absmax first (same value)."""
    peak = x.abs().amax(-1, keepdim=True).clamp_min(NORM_FLOOR)  # [..., 1]
    y = x / peak  # |y| <= 1: its squares cannot overflow
    squares = (y * y).mean(-1, keepdim=True) if mean else (y * y).sum(-1, keepdim=True)
    return y * torch.rsqrt(squares + eps / (peak * peak))


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps), overflow-safe in fp16."""
    return _safe_rsqrt_scaled(x, eps, mean=True)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x * rsqrt(sum(x^2) + eps) (the delta rule's l2norm), overflow-safe in fp16."""
    return _safe_rsqrt_scaled(x, eps, mean=False)


class Region(nn.Module):
    """One op family (`FAMILIES`), called as `region(fn, *args)`. Its ops carry the module scope
    `regions.<family>` through `torch.jit.trace` into Core ML's program (coremltools' TORCHSCRIPT_MODULE_NAME),
    where the exporter's op selector keeps the chosen families in fp32. In torch, `dtype` (None: the part's) is
    what the family computes in: floating inputs cast to it, the output cast back; the parameters it reads
    follow the activations (`_like`), as Core ML casts an fp16 weight into an fp32 op. No parameters of its own:
    the state dict is the decoder's."""

    def __init__(self, family: str):
        super().__init__()
        self.family = family
        self.dtype: torch.dtype | None = None

    def forward(self, fn, *args):
        if self.dtype is None:
            return fn(*args)
        back = next(arg.dtype for arg in args if isinstance(arg, Tensor))
        cast = tuple(arg.to(self.dtype) if isinstance(arg, Tensor) and arg.is_floating_point() else arg for arg in args)
        out = fn(*cast)
        return tuple(t.to(back) for t in out) if isinstance(out, tuple) else out.to(back)


def _like(parameter: Tensor, x: Tensor) -> Tensor:
    """`parameter` in x's dtype for a matmul (elementwise ops promote by themselves); unchanged, and so absent
    from the trace, when it already is (the exporter's fp32 trace)."""
    return parameter if parameter.dtype == x.dtype else parameter.to(x.dtype)


def _linear(linear: nn.Module, x: Tensor) -> Tensor:
    """A projection (nn.Linear without bias, or ExportLinear) in x's dtype."""
    if isinstance(linear, ExportLinear) or linear.weight.dtype == x.dtype:
        return linear(x)
    return F.linear(x, _like(linear.weight, x))


def _offset_norm(norm: RMSNorm, x: Tensor) -> Tensor:
    """Qwen3_5RMSNorm, (1 + w) x_hat."""
    return rms_normalize(x, norm.eps) * (1.0 + norm.weight)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NeoX RoPE on the first rd dims of x [B, L, H, hd]; cos, sin [L, rd] (as `apply_rotary_`, not in place)."""
    rd = static_shape(cos)[-1]
    half = rd // 2
    rotary, rest = x[..., :rd], x[..., rd:]
    turned = torch.cat((-rotary[..., half:], rotary[..., :half]), dim=-1)  # rotate_half
    rotated = rotary * cos[:, None, :] + turned * sin[:, None, :]
    return torch.cat((rotated, rest), dim=-1)


class ExportLinear(nn.Module):
    """A bias-free linear for export: a dense `weight` [O, I] (an 8-bit bundle's in its plain form: Core ML's
    quantizer rounds it to 8 bits per channel)."""

    def __init__(self, weight: Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, _like(self.weight, x))


def _gates(net: GatedDeltaNet, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """The delta rule's decay (log) and write strength from the gate projections' outputs."""
    return -net.A_log.exp() * F.softplus(a + net.dt_bias), torch.sigmoid(b)  # g, beta [B, L, Hv]


def _gated_norm(net: GatedDeltaNet, out: Tensor, z: Tensor) -> Tensor:
    """The DeltaNet's gated RMSNorm: rms(out) * w * silu(z)."""
    return rms_normalize(out, net.norm.eps) * net.norm.weight * F.silu(z)


def _delta_net(net: GatedDeltaNet, x: Tensor, chunk_size: int, regions: nn.ModuleDict) -> Tensor:
    """GatedDeltaNet.forward from a zero state: x [B, L, D] -> [B, L, D]."""
    B, L, _ = static_shape(x)
    Hk, Hv, Dk, Dv = net.num_k_heads, net.num_v_heads, net.head_k_dim, net.head_v_dim
    project, norms = regions["projections"], regions["norms"]
    mixed = project(_linear, net.in_proj_qkv, x)  # [B, L, conv_dim]
    taps = net.conv1d.weight[:, 0, :].t()  # [K, conv_dim]; the last tap multiplies the current token
    K = static_shape(taps)[0]
    padded = F.pad(mixed, (0, 0, K - 1, 0))  # [B, K-1+L, conv_dim]
    conv = padded[:, K - 1 :] * taps[K - 1]
    for i in range(K - 1):
        conv = conv + padded[:, i : i + L] * taps[i]
    mixed = F.silu(conv)
    query, key, value = mixed.split((net.key_dim, net.key_dim, net.value_dim), dim=-1)
    query = norms(l2_normalize, query.reshape(B, L, Hk, Dk)) * Dk**-0.5
    key = norms(l2_normalize, key.reshape(B, L, Hk, Dk))
    core = regions["delta_rule"]
    g, beta = core(_gates, net, project(_linear, net.in_proj_a, x), project(_linear, net.in_proj_b, x))
    out = core(static_chunk_gated_delta_rule, query, key, value.reshape(B, L, Hv, Dv), g, beta, chunk_size)
    out = regions["gated_norm"](_gated_norm, net, out, project(_linear, net.in_proj_z, x).reshape(B, L, Hv, Dv))
    return project(_linear, net.out_proj, out.reshape(B, L, net.value_dim))


def _attention(attn: GatedAttention, x: Tensor, cos: Tensor, sin: Tensor, regions: nn.ModuleDict) -> Tensor:
    """GatedAttention.forward without a state: x [B, L, D] -> [B, L, D], causal."""
    B, L, _ = static_shape(x)
    H, Hkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    project, norms = regions["projections"], regions["norms"]
    packed = project(_linear, attn.q_proj, x).reshape(B, L, H, 2, hd)  # rows [q_h | gate_h]
    query, gate = packed[:, :, :, 0], packed[:, :, :, 1]  # [B, L, H, hd]
    query = norms(_offset_norm, attn.q_norm, query)
    key = norms(_offset_norm, attn.k_norm, project(_linear, attn.k_proj, x).reshape(B, L, Hkv, hd))
    value = project(_linear, attn.v_proj, x).reshape(B, L, Hkv, hd)
    out = regions["attention"](_gated_attention, query, key, value, gate, cos, sin)
    return project(_linear, attn.o_proj, out)


def _gated_attention(query: Tensor, key: Tensor, value: Tensor, gate: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE, causal grouped attention and the sigmoid gate: query, gate [B, L, H, hd], key, value [B, L, Hkv, hd]
    -> [B, L, H * hd]."""
    B, L, H, hd = static_shape(query)
    Hkv = static_shape(key)[2]
    query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)

    def heads(t: Tensor, count: int) -> Tensor:  # [B, L, count, hd] -> [B, H, L, hd], KV head h // (H / count)
        t = t.transpose(1, 2)
        return t[:, :, None].expand(B, count, H // count, L, hd).reshape(B, H, L, hd)

    out = F.scaled_dot_product_attention(heads(query, H), heads(key, Hkv), heads(value, Hkv), attn_mask=_causal_mask(cos))
    return out.transpose(1, 2).reshape(B, L, H * hd) * torch.sigmoid(gate.reshape(B, L, H * hd))


def _causal_mask(cos: Tensor) -> Tensor:
    """[L, L] additive causal mask (MASKED above the diagonal), computed from an input at run time.

    A mask of constants (`is_causal`, or one built from `arange`) is folded by coremltools into a constant
    of L^2 entries per function, which at L = 8192 is 64 MB in every part: `cos * 0` makes it data, and
    the positions are counted in int32 (fp16 counts exactly only to 2048).
    """
    positions = ((cos[:, :1] * 0).int() + 1).cumsum(0)  # [L, 1]: 1, 2, ..., L as int32
    future = positions.t() > positions  # [L, L]: key j after query i
    return future.to(cos.dtype) * MASKED


def _layer(layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, chunk_size: int, regions: nn.ModuleDict) -> Tensor:
    project, norms = regions["projections"], regions["norms"]
    h = norms(_offset_norm, layer.input_layernorm, x)
    if layer.layer_type == "linear_attention":
        h = _delta_net(layer.linear_attn, h, chunk_size, regions)
    else:
        h = _attention(layer.self_attn, h, cos, sin, regions)
    x = x + h
    h = norms(_offset_norm, layer.post_attention_layernorm, x)
    mlp = layer.mlp
    return x + project(_linear, mlp.down_proj, F.silu(project(_linear, mlp.gate_proj, h)) * project(_linear, mlp.up_proj, h))


class ExportPart(nn.Module):
    """Decoder layers `layers` (a dict from the decoder's layer index) and, on the last part, the final norm.

    State-dict names are the decoder's (`layers.5.linear_attn.in_proj_qkv.weight`, `norm.weight`); `regions`
    holds one `Region` per op family (no tensors)."""

    def __init__(self, layers: dict[int, DecoderLayer], norm: RMSNorm | None = None, chunk_size: int = 64):
        super().__init__()
        self.layers = nn.ModuleDict({str(index): layer for index, layer in sorted(layers.items())})
        self.norm = norm
        self.chunk_size = chunk_size
        self.regions = nn.ModuleDict({family: Region(family) for family in FAMILIES})

    def compute_families(self, dtypes: dict[str, torch.dtype | None]) -> "ExportPart":
        """Sets each named family's compute dtype in torch (None: the part's); the others are left as they are."""
        unknown = sorted(set(dtypes) - set(FAMILIES))
        if unknown:
            raise ValueError(f"unknown op families {unknown}: the families are {', '.join(FAMILIES)}")
        for family, dtype in dtypes.items():
            self.regions[family].dtype = dtype
        return self

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = hidden  # [1, L, D]
        for layer in self.layers.values():
            x = _layer(layer, x, cos, sin, self.chunk_size, self.regions)
        return self.regions["norms"](_offset_norm, self.norm, x) if self.norm is not None else x


# -- the head ------------------------------------------------------------------------------------------------


def _unit(x: Tensor) -> Tensor:
    """F.normalize(x, dim=-1) (eps 1e-12) in converted ops."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True).clamp_min(1e-24))


def _attend(attention: nn.Module, queries: Tensor, memory: Tensor, mask: Tensor) -> Tensor:
    """torch.nn.MultiheadAttention with the head's packed projections: queries [Lq, w], memory [Lk, w]
    (keys and values), mask [Lk] additive -> [Lq, w]."""
    queries_count, width = static_shape(queries)
    heads = attention.heads
    weight, bias = attention.in_proj_weight, attention.in_proj_bias

    def project(x: Tensor, part: int) -> Tensor:  # -> [heads, len, w/heads]
        rows = slice(part * width, (part + 1) * width)
        return F.linear(x, weight[rows], bias[rows]).reshape(static_shape(x)[0], heads, -1).transpose(0, 1)

    q, k, v = project(queries, 0), project(memory, 1), project(memory, 2)
    scores = (q @ k.transpose(-1, -2)) * (width // heads) ** -0.5 + mask  # [heads, Lq, Lk]
    out = torch.softmax(scores, dim=-1) @ v  # [heads, Lq, w/heads]
    return attention.out_proj(out.transpose(0, 1).reshape(queries_count, width))


class ExportHead(nn.Module):
    """`JointHead` (SPEC §5) at a fixed shape from the port's inputs (module doc); names under `head.`."""

    def __init__(self, head: JointHead):
        super().__init__()
        self.head = head

    def forward(
        self,
        states: Tensor,
        mem_mask: Tensor,
        last: Tensor,
        q_mean: Tensor,
        o_mean: Tensor,
        o2q: Tensor,
        lexical: Tensor,
        type_oh: Tensor,
        q_mask: Tensor,
        o_mask: Tensor,
    ) -> Tensor:
        head = self.head
        width = head.config.width
        normed = head.hidden_norm(states)  # Hn [L, D]
        memory = head.memory_projection(normed)  # [L, w]
        last_state = last @ normed  # g [D]
        question_means = q_mean @ normed  # q_i [Q, D]
        routed = (
            head.option_context_projection(o_mean @ normed)
            + head.option_lexical_projection(lexical)
            + head.option_question_projection(o2q @ question_means)
        )  # r [O, w]
        for layer in head.evidence_layers:
            routed = routed + _attend(layer.attention, layer.query_norm(routed), layer.memory_norm(memory), mem_mask)
            routed = routed + layer.feedforward(layer.feedforward_norm(routed))

        base_fields = head.question_projection(question_means)  # b [Q, w]
        scores = (routed * (o2q @ base_fields)).sum(-1) / math.sqrt(width)  # [O]
        owners = o2q.transpose(0, 1)  # [Q, O]
        weights = torch.softmax(scores[None, :] * owners + (1.0 - owners) * MASKED, dim=-1) * owners  # a
        fields = (
            base_fields
            + head.option_summary_norm(weights @ routed)
            + head.global_projection(last_state)[None, :]
            + type_oh @ head.type_embedding.weight
        )  # f [Q, w]
        for layer in head.layers:
            normed_fields = layer.norm1(fields)
            fields = fields + _attend(layer.self_attn, normed_fields, normed_fields, q_mask)
            fields = fields + _attend(layer.multihead_attn, layer.norm2(fields), memory, mem_mask)
            fields = fields + layer.linear2(F.gelu(layer.linear1(layer.norm3(fields))))
        fields = head.field_norm(fields)  # F [Q, w]

        anchor = o2q @ _unit(question_means + last_state[None, :])  # [O, D]
        prior = (_unit(lexical) * anchor).sum(-1)  # [O]
        options = head.option_norm(routed)  # o [O, w]
        option_fields = o2q @ fields  # [O, w]
        cosine = (_unit(option_fields) * _unit(options)).sum(-1)
        features = torch.cat((option_fields, options, option_fields * options, (option_fields - options).abs()), -1)
        residual = head.residual_scorer(features).squeeze(-1)  # [O]
        prior_scale = head.prior_logit_scale.clamp(max=LOG_MAX_LOGIT_SCALE).exp()
        joint_scale = head.joint_logit_scale.clamp(max=LOG_MAX_LOGIT_SCALE).exp()
        logits = prior_scale * prior + torch.sigmoid(head.residual_gate) * (joint_scale * cosine + residual)
        return logits + o_mask
