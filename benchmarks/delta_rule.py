"""Gated delta rule on CPU: our chunked kernel vs transformers' `torch_chunk_gated_delta_rule`.

    python benchmarks/delta_rule.py [--length 370] [--repeats 15] [--threads N]

Both run the whole kernel from raw q, k (l2norm + q scaling included, as in a GDN layer) in fp32:
ours is `l2norm` + `chunk_gated_delta_rule`, transformers' is called with `use_qk_l2norm_in_kernel=True`.
Two shapes: 32 value heads on 32 key heads (the brief's H=32) and the 9B's 32 value heads on 16 key heads.
Runs them alternately (same machine load for both) and prints the median and min time of each, the ratio,
the max relative difference of the outputs, and how many compute aten ops (views excluded) each dispatches per call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from clef_flash.model.ops.gated_delta_rule import chunk_gated_delta_rule, l2norm


def ours(q, k, v, g, beta):
    scale = q.shape[-1] ** -0.5
    return chunk_gated_delta_rule(l2norm(q) * scale, l2norm(k), v, g, beta)


# aten ops that touch no data (views and metadata) are not counted
NOT_COMPUTE = {"aten._unsafe_view", "aten.promote_types"}


class CountOps(TorchDispatchMode):
    """Counts the aten ops a call dispatches that compute or allocate (views and metadata ops excluded)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and str(func.overloadpacket) not in NOT_COMPUTE:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def op_count(fn) -> int:
    with CountOps() as counter:
        fn()
    return counter.ops


def interleaved_ms(fns, repeats: int) -> list[list[float]]:
    """Times (ms) of each fn, run alternately so that both see the same machine load."""
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=370)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    def reference(q, k, v, g, beta):
        return torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, T={args.length}, B=1, Dk=Dv=128, fp32")
    torch.manual_seed(0)
    for key_heads, value_heads in ((32, 32), (16, 32)):
        T = args.length
        q = torch.randn(1, T, key_heads, 128)
        k = torch.randn(1, T, key_heads, 128)
        v = torch.randn(1, T, value_heads, 128)
        g = -torch.rand(1, T, value_heads) * 0.5
        beta = torch.rand(1, T, value_heads)
        with torch.inference_mode():
            ours_t, ref_t = interleaved_ms(
                [lambda: ours(q, k, v, g, beta), lambda: reference(q, k, v, g, beta)], args.repeats
            )
            o_ours, s_ours = ours(q, k, v, g, beta)
            o_ref, s_ref = reference(q, k, v, g, beta)
        ops_ours = op_count(lambda: ours(q, k, v, g, beta))
        ops_ref = op_count(lambda: reference(q, k, v, g, beta))
        diff = ((o_ours - o_ref).abs().max() / o_ref.abs().max()).item()
        sdiff = ((s_ours - s_ref).abs().max() / s_ref.abs().max()).item()
        ours_ms, ref_ms = statistics.median(ours_t), statistics.median(ref_t)
        print(
            f"Hk={key_heads:2d} Hv={value_heads}: median ours {ours_ms:7.2f} ms, transformers {ref_ms:7.2f} ms, "
            f"ratio {ref_ms / ours_ms:4.2f}x (min {min(ours_t):.2f} / {min(ref_t):.2f} ms); "
            f"max rel diff out {diff:.1e}, state {sdiff:.1e}; compute ops {ops_ours} vs {ops_ref}"
        )


if __name__ == "__main__":
    main()
