"""The 8-bit bundle at real size: a random release with the full 9B shapes, converted, loaded and answering.

    python benchmarks/bundle_9b.py [--dir runs] [--config 9b] [--precision default] [--answer-from bundle]
    python benchmarks/bundle_9b.py --answer-from release    # the release itself, no conversion (issue 25)
    python benchmarks/bundle_9b.py --memory-gb 11           # the default as an 11 GB machine picks it
    python benchmarks/bundle_9b.py --precision default,int8-weight-only --rounds 2   # both, alternating
    python benchmarks/bundle_9b.py --config 27b     # Clef 27B's shapes: on 24 GB, 8-bit with streamed layers (issue 43)
    python benchmarks/bundle_9b.py --baseline-src ../old/src --rounds 2   # an older checkout's load beside this one's (issue 50)

Converts `random:9b` (32 layers, hidden 4096, vocabulary 248,320; each tensor drawn as it is converted, no release
written) to `DIR/bundle-9b` as `clef-flash convert random:9b DIR/bundle-9b` does unless it is there (with
`--answer-from release`, writes `DIR/release-9b` instead: about 19 GB of bf16, never committed), then in a fresh
process loads the bundle and answers one
~370-token, 3-question record three times (the first reads the weights from disk and packs them for this
CPU; the faster of the other two is the warm figure, both are printed), then once more with the state cache emptied
first (`warm_fresh_s`: the warm runs reuse the first's 127-token prefix, the first cannot, so the first answer is
held to this one, like for like). Each step runs in its own process, so each peak
RSS is its own. `--precision` takes a comma-separated list (`default`: precision=None), one fresh process each,
alternating for `--rounds` rounds. `--answer-from release` skips the conversion and answers from the release (what a user who
never converts gets: with no precision, the default that fits this machine's memory).
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_step(code: str) -> tuple[dict, float, float]:
    """Run `code` in a fresh Python; it prints one JSON line last. Returns (it, wall seconds, peak RSS GB)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - start
    if result.returncode:
        sys.exit(f"step failed:\n{result.stderr[-3000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the largest child so far: a later step smaller than an earlier one reports
    # its own peak itself
    return json.loads(result.stdout.strip().splitlines()[-1]), wall, max(peak, before) / 1024**2


def directory_gb(path: Path) -> float:
    return sum(file.stat().st_size for file in path.iterdir() if file.is_file()) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="runs", help="where the release and the bundle are written (gitignored)")
    parser.add_argument("--config", default="9b", help="random config name (9b; 9b-part for a quicker run)")
    parser.add_argument("--precision", default="default", help="default (this machine's), int8-weight-only or int8-w8a8")
    parser.add_argument("--answer-from", choices=("bundle", "release"), default="bundle")
    parser.add_argument("--memory-gb", type=float, help="choose the default as on a machine with this much memory available")
    parser.add_argument("--json", type=Path, help="also write every answer step's figures to this file")
    parser.add_argument("--rounds", type=int, default=1, help="answer steps per precision, alternating")
    parser.add_argument("--baseline-src", type=Path, help="also load with the clef_flash package under this src folder "
                        "(an older checkout's), alternating with this checkout's in each round")
    args = parser.parse_args()
    base = Path(args.dir).resolve()
    release, bundle = base / f"release-{args.config}", base / f"bundle-{args.config}"

    if args.answer_from == "release" and not (release / "config.json").is_file():
        print(f"writing the random {args.config} release to {release} ...", flush=True)
        _, wall, peak = run_step(
            f"""
            import json
            from clef_flash.checkpoint.random_release import write_random_release
            write_random_release({str(release)!r}, {args.config!r}, seed=0)
            print(json.dumps({{}}))
            """
        )
        print(f"  written in {wall:.0f} s ({directory_gb(release):.1f} GB)", flush=True)

    if args.answer_from == "bundle" and not (bundle / "manifest.json").is_file():
        print(f"converting to {bundle} ...", flush=True)
        _, convert_s, convert_rss = run_step(
            f"""
            import json
            from clef_flash.conversion import convert
            convert("random:{args.config}", {str(bundle)!r}, overwrite=True, progress=False)
            print(json.dumps({{}}))
            """
        )
        print(f"  {convert_s:.0f} s, peak RSS {convert_rss:.2f} GB, bundle {directory_gb(bundle):.2f} GB", flush=True)
    answered = bundle if args.answer_from == "bundle" else release

    sources = {"this": ROOT / "src"} | ({"baseline": args.baseline_src.resolve()} if args.baseline_src else {})
    results = []
    for round_index in range(args.rounds):
        for (source, src), asked in itertools.product(reversed(sources.items()), args.precision.split(",")):
            answer = answer_step(answered, None if asked == "default" else asked, args.memory_gb, src)
            answer.update(asked=asked, round=round_index, source=source, src=str(src))
            results.append(answer)
            print(
                f"{answered.name} [{source}, {asked}, round {round_index + 1}]: {answer['precision']} ({answer['why']}): "
                f"load until ready {answer['ready_s']:.2f} s; {answer['tokens']}-token record: first answer "
                f"{answer['first_s']:.1f} s (weights read and packed), warm {answer['warm_s']:.2f} s "
                f"(runs {', '.join(f'{s:.2f}' for s in answer['warm_all_s'])}; state cache emptied {answer['warm_fresh_s']:.2f}, "
                f"first / that {answer['first_s'] / answer['warm_fresh_s']:.2f}x); peak RSS {answer['own_peak_rss_gb']:.2f} GB",
                flush=True,
            )
            print(f"  plan: {answer['plan']}; last answer by stage: {answer['timings']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


def answer_step(answered: Path, precision: str | None, memory_gb: float | None, src: Path = ROOT / "src") -> dict:
    """Load `answered` in a fresh process (clef_flash from `src`) and answer the typical record three times, then once
    with the state cache emptied; the figures."""
    answer, _, _ = run_step(
        f"""
        import json, resource, sys, time
        sys.path.insert(0, {str(src)!r})
        sys.path.insert(1, "benchmarks")
        start = time.perf_counter()
        import clef_flash
        import clef_flash.loader
        from common import typical_request
        if {memory_gb!r} is not None:  # the default as a machine with this much memory available chooses it
            clef_flash.loader.available_memory_bytes = lambda: int({memory_gb!r} * 1e9)
        model = clef_flash.load({str(answered)!r}, device="cpu", precision={precision!r})
        ready = time.perf_counter() - start
        request = typical_request()
        times = []
        for _ in range(3):
            begin = time.perf_counter()
            model.answer(request)
            times.append(time.perf_counter() - begin)
        model.state_cache.clear()
        begin = time.perf_counter()
        model.answer(request)
        fresh = time.perf_counter() - begin
        print(json.dumps({{"ready_s": ready, "first_s": times[0], "warm_s": sorted(times[1:])[0], "warm_fresh_s": fresh,
                          "clef_flash": clef_flash.__file__,
                          "warm_all_s": times[1:], "precision": model.precision, "why": model.precision_policy.reason,
                          "plan": model.plan.describe(),
                          "own_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
                          "tokens": model.last_timings.tokens, "timings": model.last_timings.as_dict()}}))
        """
    )
    return answer


if __name__ == "__main__":
    main()
