"""Many clef-finetune adapters on one base (issue 42): the figures of the README's adapters row.

    python benchmarks/adapters.py [--config 9b-part] [--adapters 8] [--rank 16] [--rounds 5] [--repeats 2] [--parts memory,speed]

- memory: RSS after loading `random:CONFIG` alone, and with `--adapters` random rank-`--rank` adapters (every
          decoder projection, and a head each: clef_flash.testing.adapters), each in a fresh process, the two
          alternating `--repeats` times. Target: the adapters cost at most their own bytes (LoRA pairs + heads)
          plus 5% of the base.
- speed:  8 records (the typical ~370-token ticket, 8 different states) as one `answer_many` call: on the base
          alone, mixed over 4 adapters (2 records each, one forward), and the same 8 one adapter at a time (4
          calls); rounds after a warm-up, each starting with another of the three, medians, in a fresh process per repeat. Target: mixed
          <= 1.3 x the base alone. The state cache is off.

The plan is the machine's default (int8 on a CPU: the adapters kept apart beside it). Run it alone on a quiet
machine (load average < 0.5); every figure says the CPU it came from. `--config tiny` checks the script in seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import TICKET, typical_request  # noqa: E402

RECORDS = 8
MIXED_OVER = 4  # adapters in the mixed batch


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "unknown CPU")


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def requests(adapters: list[str | None]) -> list[dict]:
    """The 8 records, record i under adapters[i] (None: no field)."""
    out = []
    for index, adapter in enumerate(adapters):
        request = typical_request()
        request["state"] = f"Ticket #{index + 1}.\n\n" + TICKET
        if adapter is not None:
            request["adapter"] = adapter
        out.append(request)
    return out


# -- children (each in a fresh process) -----------------------------------------------------------


def child_memory(config: str, adapter_dirs: list[str]) -> dict:
    import clef_flash
    from clef_flash.checkpoint.safetensors_io import return_free_heap

    before = rss_bytes()
    model = clef_flash.load(f"random:{config}", adapters={f"a{i}": path for i, path in enumerate(adapter_dirs)}, state_cache_mb=0)
    model.answer(typical_request())  # what a first answer allocates counts too
    gc.collect()
    return_free_heap()
    described = model.describe().get("adapters", [])
    return {
        "rss_bytes": rss_bytes() - before,
        "adapter_bytes": sum(item["bytes"] for item in described),
        "precision": model.precision,
        "modes": sorted({item["mode"] for item in described}),
    }


def child_speed(config: str, adapter_dirs: list[str], rounds: int) -> dict:
    import clef_flash

    names = [f"a{i}" for i in range(len(adapter_dirs))]
    model = clef_flash.load(f"random:{config}", adapters=dict(zip(names, adapter_dirs)), state_cache_mb=0)
    base = requests([None] * RECORDS)
    mixed = requests([names[index % MIXED_OVER] for index in range(RECORDS)])
    per_adapter = [[request for request in mixed if request["adapter"] == name] for name in names[:MIXED_OVER]]

    def one_at_a_time() -> None:
        for group in per_adapter:
            model.answer_many(group)

    runs = {"base": lambda: model.answer_many(base), "mixed": lambda: model.answer_many(mixed), "one adapter at a time": one_at_a_time}
    for run in runs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    items = list(runs.items())
    for round_number in range(rounds):  # each round starts with another of the three
        for name, run in items[round_number % 3 :] + items[: round_number % 3]:
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1000)
    forwards = model.last_timings.forwards
    model.answer_many(mixed)
    return {"ms": times, "precision": model.precision, "mixed_forwards": model.last_timings.forwards, "last_forwards": forwards}


# -- the parent ------------------------------------------------------------------------------------


def run_child(settings: argparse.Namespace, *args: str) -> dict:
    command = [sys.executable, __file__, "--config", settings.config, "--rounds", str(settings.rounds), "--child", *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"child {args[0]} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="9b-part", help="a random config (clef_flash.checkpoint.random_release)")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per measurement")
    parser.add_argument("--parts", default="memory,speed")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        kind, dirs = args.child[0], json.loads(args.child[1])
        result = child_memory(args.config, dirs) if kind == "memory" else child_speed(args.config, dirs, args.rounds)
        print(json.dumps(result))
        return

    from clef_flash.testing.adapters import write_random_adapter

    parts = set(args.parts.split(","))
    print(f"CPU: {cpu_name()}; config {args.config}; {args.adapters} adapters of rank {args.rank}")
    with tempfile.TemporaryDirectory(prefix="clef-adapters-") as scratch:
        dirs = [
            str(write_random_adapter(Path(scratch) / f"adapter-{i}" / "checkpoint-1", args.config, rank=args.rank, seed=i))
            for i in range(max(args.adapters, MIXED_OVER))
        ]
        if "memory" in parts:
            base_rss, with_rss, adapter_bytes, modes = [], [], 0, []
            for _ in range(args.repeats):  # alternating fresh processes
                base_rss.append(run_child(args, "memory", json.dumps([]))["rss_bytes"])
                loaded = run_child(args, "memory", json.dumps(dirs[: args.adapters]))
                with_rss.append(loaded["rss_bytes"])
                adapter_bytes, modes, precision = loaded["adapter_bytes"], loaded["modes"], loaded["precision"]
            base, with_adapters = statistics.median(base_rss), statistics.median(with_rss)
            extra = with_adapters - base
            allowed = adapter_bytes + 0.05 * base
            print(
                f"memory ({precision}, adapters {', '.join(modes)}): base {base / 2**20:,.0f} MiB; with {args.adapters} adapters "
                f"{with_adapters / 2**20:,.0f} MiB: +{extra / 2**20:,.1f} MiB for {adapter_bytes / 2**20:,.1f} MiB of adapters "
                f"(their bytes + {(extra - adapter_bytes) / base * 100:+.1f}% of the base; target <= +5%: "
                f"{'met' if extra <= allowed else 'NOT met'})"
            )
        if "speed" in parts:
            medians: dict[str, list[float]] = {}
            for _ in range(args.repeats):
                result = run_child(args, "speed", json.dumps(dirs[:MIXED_OVER]))
                for name, times in result["ms"].items():
                    medians.setdefault(name, []).append(statistics.median(times))
            base = statistics.median(medians["base"])
            mixed = statistics.median(medians["mixed"])
            apart = statistics.median(medians["one adapter at a time"])
            print(
                f"speed ({result['precision']}): {RECORDS} records, ~370 tokens each; base alone {base:,.1f} ms; mixed over "
                f"{MIXED_OVER} adapters in {result['mixed_forwards']} forward(s) {mixed:,.1f} ms ({mixed / base:.2f}x the base; target "
                f"<= 1.3x: {'met' if mixed <= 1.3 * base else 'NOT met'}); one adapter at a time {apart:,.1f} ms "
                f"({apart / base:.2f}x)"
            )


if __name__ == "__main__":
    main()
