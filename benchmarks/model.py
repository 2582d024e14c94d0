"""Whole-record latency: clef-flash beside the reference path (transformers + the authors' head), same run.

    python benchmarks/model.py [--config 9b-part] [--precisions fp32,bf16,int8] [--repeats 3] [--rounds 2]

An int8 row (ours: int8 weights from the release, quantized at load) runs beside the reference in
`--int8-reference` precision (default bf16: the reference has no 8-bit path).
    python benchmarks/model.py --profile bf16      # where our time goes: ops by self time, and stage timings

A ~370-token record with 3 questions on a random release (default: one 4-layer "part" of the 9B model,
hidden 4096, full vocabulary; written once to --release-dir, 6.4 GB). Each implementation runs in its
own process so that peak RSS is its own; the two alternate for --rounds rounds (this shared machine is
noisy), and the table gives the median over rounds with the spread of the per-round speed-ups. Reports medians, ratios, peak RSS, and the fraction of this
machine's matmul rate (measured in the same run) that the whole record reaches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from common import median_ms, peak_rss_mb, typical_request  # noqa: E402


def decoder_flops(text, tokens: int) -> float:
    """Matmul FLOPs of one record through the decoder (2 x MACs; qwen35.md §11)."""
    d, ffn = text.hidden_size, text.intermediate_size
    mlp = 3 * d * ffn
    key_dim = text.linear_num_key_heads * text.linear_key_head_dim
    value_dim = text.linear_num_value_heads * text.linear_value_head_dim
    gdn = d * (2 * key_dim + value_dim) + d * value_dim + 2 * d * text.linear_num_value_heads + value_dim * d
    q = text.num_attention_heads * text.head_dim
    kv = text.num_key_value_heads * text.head_dim
    attention = d * 2 * q + 2 * d * kv + q * d
    per_token = sum(2 * ((gdn if kind == "linear_attention" else attention) + mlp) for kind in text.layer_types)
    return per_token * tokens


def run_one(args) -> None:
    """Child process: time one implementation, print one JSON line."""
    import torch

    request = typical_request()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(args.precision)
    root = Path(args.release_dir)
    started = time.perf_counter()
    if args.impl == "ours":
        import clef_flash

        model = clef_flash.load(root, device="cpu", precision=args.precision)
        tokens = model.encode(request).token_count
        function = lambda: model.logits(request)  # noqa: E731
    else:
        from conftest import ReferenceModel, load_reference_module

        model = ReferenceModel(load_reference_module(), root, dtype)
        tokens = len(model.encode(request).input_ids)
        function = lambda: model.logits(request)  # noqa: E731
    load_s = time.perf_counter() - started
    ms = median_ms(function, repeats=args.repeats, warmup=1)
    logits = function()
    print(json.dumps({"impl": args.impl, "precision": args.precision, "median_ms": ms, "tokens": tokens,
                      "load_s": load_s, "peak_rss_mb": peak_rss_mb(), "logits": logits}))


def profile_ours(root: Path, precision: str) -> None:
    """Our record in the torch profiler: the share of each op, and tokenize / decoder / head times."""
    import clef_flash
    from torch.profiler import ProfilerActivity, profile

    model = clef_flash.load(root, device="cpu", precision=precision)
    request = typical_request()
    model.logits(request)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        model.logits(request)
    print(f"stage timings (ms): {model.last_timings.as_dict()}")
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def matmul_rate(precision: str) -> float:
    """GFLOP/s of a 4096-square matmul in this dtype on this machine, now."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(precision, torch.float32)  # int8: fp32 compute
    a = torch.randn(4096, 4096, dtype=dtype)
    b = torch.randn(4096, 4096, dtype=dtype)
    ms = median_ms(lambda: a @ b, repeats=5, warmup=1)
    return 2 * 4096**3 / (ms / 1000) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="9b-part")
    parser.add_argument("--release-dir", default="runs/release-9b-part")
    parser.add_argument("--precisions", default="fp32,bf16,int8")
    parser.add_argument("--int8-reference", default="bf16", help="the reference's precision beside an int8 row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", choices=["fp32", "bf16"], help="profile our path in this precision instead")
    parser.add_argument("--impl", choices=["ours", "reference"], help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.impl:
        run_one(args)
        return
    if args.profile:
        profile_ours(Path(args.release_dir), args.profile)
        return

    from clef_flash.model.config import TextConfig
    from clef_flash.checkpoint.random_release import write_random_release

    root = Path(args.release_dir)
    if not (root / "config.json").exists():
        print(f"writing a random {args.config!r} release to {root} ...", flush=True)
        write_random_release(root, args.config, seed=0)
    text = TextConfig.from_release_config(json.loads((root / "config.json").read_text()))
    rows = []
    for precision in args.precisions.split(","):
        runs: dict[str, list[dict]] = {"reference": [], "ours": []}
        for _ in range(args.rounds):
            for impl in ("reference", "ours"):
                run_precision = args.int8_reference if impl == "reference" and precision.startswith("int8") else precision
                command = [sys.executable, __file__, "--impl", impl, "--precision", run_precision,
                           "--release-dir", str(root), "--repeats", str(args.repeats)]
                output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
                runs[impl].append(json.loads(output.strip().splitlines()[-1]))
        ratios = [r["median_ms"] / o["median_ms"] for r, o in zip(runs["reference"], runs["ours"])]
        results = {}
        for impl, impl_runs in runs.items():
            results[impl] = dict(impl_runs[0], median_ms=statistics.median(run["median_ms"] for run in impl_runs),
                                 peak_rss_mb=max(run["peak_rss_mb"] for run in impl_runs))
        results["ours"]["ratios"] = ratios
        ours, reference = results["ours"], results["reference"]
        worst = 0.0
        for question_id, options in reference["logits"].items():
            scale = max(abs(v) for v in options.values())
            worst = max(worst, max(abs(ours["logits"][question_id][k] - v) for k, v in options.items()) / scale)
        rate = matmul_rate(precision)
        flops = decoder_flops(text, ours["tokens"])
        rows.append((precision, reference, ours, worst, rate, flops))

    print(f"\nrelease {root} ({args.config}: hidden {text.hidden_size}, {text.num_hidden_layers} layers), "
          f"record {rows[0][2]['tokens']} tokens, 3 questions, median of {args.repeats} per run, {args.rounds} alternating rounds")
    print(f"{'precision':>9} {'reference ms':>13} {'ours ms':>9} {'speed-up':>9} {'ref RSS MB':>11} {'our RSS MB':>11} "
          f"{'matmul GF/s':>12} {'ours % of rate':>15} {'max rel logit diff':>19}  per-round speed-ups")
    for precision, reference, ours, worst, rate, flops in rows:
        achieved = flops / (ours["median_ms"] / 1000) / 1e9
        print(f"{precision:>9} {reference['median_ms']:13.0f} {ours['median_ms']:9.0f} "
              f"{reference['median_ms'] / ours['median_ms']:8.2f}x {reference['peak_rss_mb']:11.0f} "
              f"{ours['peak_rss_mb']:11.0f} {rate:12.0f} {100 * achieved / rate:14.0f}% {worst:19.2e}  "
              + ", ".join(f"{ratio:.2f}x" for ratio in ours["ratios"]))


if __name__ == "__main__":
    main()
