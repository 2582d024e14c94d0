"""The GPU path measured in one command (issue 49): parity, agreement, latency, throughput, batching, memory.

    python benchmarks/gpu.py [--budget-s 480] [--out benchmarks/results/gpu-DATE.json]   # on a CUDA machine
    python benchmarks/gpu.py --dry-run [--out FILE]                                       # anywhere, in seconds

Stages, each recorded in the JSON with its raw per-round timings (a stage that does not fit what is left of
`--budget-s` is recorded as skipped, so a short lease still comes back with a file):
1. parity: a small random release (`9b-heads`) answered on the GPU in fp32 and on the CPU in fp32, 8 requests:
   `fp32_max_rel_logit_error` (target <= 1e-4).
2. agreement, on the same release and 20 requests (~50 questions), against the authors' fp32 (the reference oracle,
   tests/conftest.py's ReferenceModel, when clef-finetune is importable; else our CPU fp32, said in `truth`): decisions
   differing and median |dp| of the reference's own bf16 (`reference_bf16_*`, on the CPU) and of our bf16, int8-w8a8
   and fp8 on the GPU (`int8_decisions_differing`, `int8_median_dp`).
3. speed on `9b-part` (full widths, 4 layers; drawn in memory), bf16 then int8-w8a8: p50 / p99 ms of a ~370-token
   record one at a time, and records/s at batch 8, 16, 32, 64 (the best kept); then the full-size random 9B in bf16
   (`random:9b`, 18 GB on the GPU; its int8 with `--full-int8`: quantizing 8B weights while loading takes minutes). The
   top-level `bf16_record_p50_ms`, `bf16_records_per_s`, `int8_records_per_s` are the largest model's measured
   (`speed_model` names it). Targets on an H100/H200, 9B: bf16 <= 12 ms p50, >= 100 records/s; int8 >= 1.6x bf16.
4. the server's batcher (server/batcher.py, the queue and worker `clef-flash serve` runs) under 16 concurrent
   clients, dynamic batching against one record at a time: `server_batching_speedup` (target >= 3x).
5. peak GPU memory per stage (`torch.cuda.max_memory_allocated`).

`--dry-run` runs every stage on `tiny` under clef_flash.testing.fake_gpu (a stand-in GPU whose tensors hold no data and
where any host sync inside a forward fails): every code path of the real run, timings meaningless (labelled), so that a
first run on a GPU spends its minutes measuring. tests/test_gpu_path.py runs it in the suite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import clef_flash  # noqa: E402
from clef_flash.bench import generated_requests  # noqa: E402
from clef_flash.checkpoint.random_release import write_random_release  # noqa: E402
from clef_flash.request.samples import random_requests  # noqa: E402

RECORD_TOKENS = 370
BATCHES = (8, 16, 32, 64)
GPU_PRECISIONS = ("bf16", "int8-w8a8", "fp8")
CLIENTS = 16


def nvidia_smi_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def commit_of() -> str | None:
    if os.environ.get("CLEF_FLASH_COMMIT"):
        return os.environ["CLEF_FLASH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


class Run:
    """The JSON being filled, the device, the time budget."""

    def __init__(self, device: torch.device, budget_s: float, dry_run: bool):
        self.device, self.dry_run = device, dry_run
        self.deadline = time.monotonic() + budget_s
        self.result: dict = {"stages": {}, "skipped": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @contextlib.contextmanager
    def stage(self, name: str, needs_s: float):
        """Run the block as stage `name` if `needs_s` seconds are left (a dry run always runs it), with its peak memory."""
        if not self.dry_run and self.left() < needs_s:
            self.result["skipped"][name] = f"{self.left():.0f} s left of the budget, about {needs_s:.0f} s needed"
            yield None
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        started = time.perf_counter()
        record: dict = {}
        yield record
        record["seconds"] = round(time.perf_counter() - started, 2)
        if self.device.type == "cuda":
            record["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)
        self.result["stages"][name] = record
        print(f"{name}: {json.dumps({k: v for k, v in record.items() if k != 'raw'})}", flush=True)

    def load(self, source, precision: str, **options):
        return clef_flash.load(source, device=self.device, precision=precision, **options)


def logits_of(model, requests) -> list[dict[str, dict[str, float]]]:
    """Per request: question -> option -> logit (the reference oracle's shape), in one batched call."""
    _, results = model._run(requests)
    return [{result.question_id: dict(zip(result.option_ids, result.logits)) for result in per} for per in results]


def aligned(have: dict[str, float], want: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two questions' logits as float64 vectors in `want`'s option order."""
    return torch.tensor([have[option] for option in want], dtype=torch.float64), torch.tensor(list(want.values()), dtype=torch.float64)


def worst_relative(got, expected) -> float:
    worst = 0.0
    for have, want in zip(got, expected):
        for question, values in want.items():
            ours, reference = aligned(have[question], values)
            worst = max(worst, ((ours - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item())
    return worst


def agreement(rows, truth) -> dict:
    """Decisions differing and median / max |dp| of each row's logits against `truth`'s."""
    out = {}
    for name, answers in rows.items():
        flips, deltas = 0, []
        for have, want in zip(answers, truth):
            for question, values in want.items():
                ours, reference = aligned(have[question], values)
                p, q = reference.softmax(-1), ours.softmax(-1)
                deltas += (q - p).abs().tolist()
                flips += int(q.argmax() != p.argmax())
        out[name] = {"decisions_differing": flips, "median_dp": statistics.median(deltas), "max_dp": max(deltas), "questions": len(deltas)}
    return out


def stage_parity_and_agreement(run: Run, work: Path, requests_count: int) -> None:
    release = write_random_release(work / "9b-heads", "tiny" if run.dry_run else "9b-heads", seed=1)
    requests = random_requests(1, requests_count)
    with run.stage("parity", 60) as record:
        if record is not None:
            cpu = logits_of(clef_flash.load(release, device="cpu", precision="fp32"), requests[:8])
            gpu = logits_of(run.load(release, "fp32"), requests[:8])
            record["fp32_max_rel_logit_error"] = worst_relative(gpu, cpu)
            run.result["fp32_max_rel_logit_error"] = record["fp32_max_rel_logit_error"]
    with run.stage("agreement", 120) as record:
        if record is None:
            return
        truth_name, reference_bf16 = "ours fp32 on the CPU (the reference oracle is not installed)", None
        try:
            from conftest import ReferenceModel, load_reference_module

            module = load_reference_module()
            truth = [ReferenceModel(module, release, torch.float32).logits(request) for request in requests]
            bf16 = ReferenceModel(module, release, torch.bfloat16)
            reference_bf16 = [bf16.logits(request) for request in requests]
            truth_name = "the authors' fp32 (transformers + JointSchemaHead, CPU)"
        except Exception as exc:  # noqa: BLE001 (the oracle's imports: pytest, clef-finetune, transformers' version)
            record["oracle_error"] = f"{type(exc).__name__}: {exc}"[:300]
            truth = logits_of(clef_flash.load(release, device="cpu", precision="fp32"), requests)
        rows = {} if reference_bf16 is None else {"reference bf16": reference_bf16}
        for precision in GPU_PRECISIONS:
            try:
                rows[f"ours {precision} (GPU path)"] = logits_of(run.load(release, precision), requests)
            except clef_flash.ClefError as exc:
                record.setdefault("refused", {})[precision] = str(exc)
        record["truth"] = truth_name
        record["rows"] = agreement(rows, truth)
        table = record["rows"]
        if "reference bf16" in table:
            run.result["reference_bf16_decisions_differing"] = table["reference bf16"]["decisions_differing"]
            run.result["reference_bf16_median_dp"] = table["reference bf16"]["median_dp"]
        if "ours int8-w8a8 (GPU path)" in table:
            run.result["int8_decisions_differing"] = table["ours int8-w8a8 (GPU path)"]["decisions_differing"]
            run.result["int8_median_dp"] = table["ours int8-w8a8 (GPU path)"]["median_dp"]


def speed(run: Run, model, rounds: int, records: int) -> dict:
    """p50 / p99 of a ~370-token record one at a time, then records/s per batch size: raw timings kept."""
    batches = (2, 4) if run.dry_run else BATCHES
    requests = generated_requests(model, records=max(records, max(batches)), tokens=RECORD_TOKENS, seed=49)
    model.state_cache.max_bytes = 0  # every record runs in full
    model.answer(requests[0])  # warm-up: the lazy graphs of batch 1
    one_at_a_time = []
    for request in requests[:records]:
        started = time.perf_counter()
        model.answer(request)
        one_at_a_time.append((time.perf_counter() - started) * 1000)
    raw: dict = {"record_ms": one_at_a_time, "batches": {}}
    for batch in batches:
        chunk = requests[:batch]
        model.batch_tokens = max(model.batch_tokens, batch * 4096)
        model.answer_many(chunk)  # warm-up: this batch's graphs
        seconds = []
        for _ in range(rounds):
            started = time.perf_counter()
            model.answer_many(chunk)
            seconds.append(time.perf_counter() - started)
        raw["batches"][batch] = seconds
    per_batch = {batch: batch / statistics.median(seconds) for batch, seconds in raw["batches"].items()}
    best = max(per_batch, key=per_batch.get)
    ordered = sorted(one_at_a_time)
    return {
        "record_p50_ms": statistics.median(one_at_a_time),
        "record_p99_ms": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
        "records_per_s_by_batch": per_batch,
        "best_batch": best,
        "records_per_s": per_batch[best],
        "tokens_per_record": statistics.mean(model.encode(request).token_count for request in requests[:records]),
        "graphs": model.engine.backend.describe().get("graphs"),
        "raw": raw,
    }


def stage_speed(run: Run, rounds: int, records: int, full_int8: bool) -> None:
    sources = [("9b-part", "tiny" if run.dry_run else "random:9b-part", ("bf16", "int8-w8a8"), 90)]
    if not run.dry_run:  # (on the stand-in the same code as the stage before)
        sources.append(("9b", "random:9b", ("bf16", "int8-w8a8") if full_int8 else ("bf16",), 240))
    for label, source, precisions, needs in sources:
        for precision in precisions:
            with run.stage(f"speed {label} {precision}", needs) as record:
                if record is None:
                    continue
                model = run.load(source, precision)
                record.update(speed(run, model, rounds, records))
                del model
                if run.device.type == "cuda":
                    torch.cuda.empty_cache()
                prefix = "bf16" if precision == "bf16" else "int8"
                if prefix == "bf16":
                    run.result["bf16_record_p50_ms"] = record["record_p50_ms"]
                    run.result["bf16_record_p99_ms"] = record["record_p99_ms"]
                run.result[f"{prefix}_records_per_s"] = record["records_per_s"]
                run.result["speed_model"] = label


def stage_delta_rule(run: Run) -> None:
    """fla's Triton chunk kernel (when installed) and the torch chunk form against the float64 token-by-token twin."""
    from clef_flash.model.ops import gated_delta_rule as ops

    with run.stage("delta rule", 30) as record:
        if record is None:
            return
        device = torch.device("cpu") if run.dry_run else run.device  # (the stand-in holds no data to compare)
        generator = torch.Generator(device=device).manual_seed(0)
        B, T, Hk, Hv, D = (1, 70, 1, 2, 32) if run.dry_run else (2, 130, 2, 4, 128)  # (odd lengths: a partial chunk)
        q = ops.l2norm(torch.randn(B, T, Hk, D, device=device, generator=generator)) * D**-0.5
        k = ops.l2norm(torch.randn(B, T, Hk, D, device=device, generator=generator))
        v = torch.randn(B, T, Hv, D, device=device, generator=generator)
        g = -torch.rand(B, T, Hv, device=device, generator=generator)
        beta = torch.rand(B, T, Hv, device=device, generator=generator)
        twin, twin_state = ops.naive_recurrent_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta)))
        paths = {"torch chunk": ops.chunk_gated_delta_rule}
        if ops._fla_chunk_kernel() is not None and device.type == "cuda":
            paths["fla chunk (Triton)"] = ops.gated_delta_rule
        else:
            record["fla"] = "not installed (pip install 'clef-flash[cuda]')" if device.type == "cuda" else "not on a CPU"
        for name, function in paths.items():
            out, state = function(q, k, v, g, beta)
            record[name] = {
                "out_rel_error": ((out.double() - twin).abs().max() / twin.abs().max()).item(),
                "state_rel_error": ((state.double() - twin_state).abs().max() / twin_state.abs().max()).item(),
            }


def stage_neighbours_and_states(run: Run) -> None:
    """bf16 on the GPU: a record alone and among 31 others (same decisions? the spread), a question set answered from a
    kept state and from scratch, and the head's share of a batch of 32 (device-synchronized timings)."""
    with run.stage("neighbours and kept states", 90) as record:
        if record is None:
            return
        model = run.load("tiny" if run.dry_run else "random:9b-part", "bf16")
        requests = generated_requests(model, records=4 if run.dry_run else 32, tokens=RECORD_TOKENS, seed=11)
        model.state_cache.max_bytes = 0
        together = logits_of(model, requests)
        alone = [logits_of(model, [request])[0] for request in requests]
        decisions = sum(
            max(want, key=want.get) != max(batched[question], key=batched[question].get)
            for batched, alone_record in zip(together, alone)
            for question, want in alone_record.items()
        )
        record["batch_vs_alone"] = {"decisions_differing": decisions, "max_rel_logit_spread": worst_relative(together, alone)}
        asked = [{**requests[0], "questions": request["questions"]} for request in requests[1:3]]
        scratch = logits_of(model, asked)
        model.state_cache.max_bytes = 1 << 30
        model.keep_from_tokens = 1
        logits_of(model, asked[:1])  # keeps the state
        kept = logits_of(model, asked)
        record["kept_vs_scratch"] = {"tokens_reused": model.last_timings.tokens_reused, "max_rel_logit_error": worst_relative(kept, scratch)}
        model.state_cache.max_bytes = 0
        os.environ["CLEF_FLASH_SYNC_TIMINGS"] = "1"
        try:
            model.answer_many(requests)
            timings = model.last_timings
        finally:
            os.environ.pop("CLEF_FLASH_SYNC_TIMINGS", None)
        record["batch_32_ms"] = {"decoder": timings.decoder_ms, "head": timings.head_ms, "total": timings.total_ms}
        record["head_share"] = timings.head_ms / max(timings.decoder_ms + timings.head_ms, 1e-9)
        run.result["head_share_batch_32"] = record["head_share"]


async def _clients(batcher, records, clients: int) -> float:
    """`clients` coroutines, each submitting its share of `records` one after the other; seconds for all."""
    shares = [records[index::clients] for index in range(clients)]

    async def client(share):
        for record in share:
            await batcher.submit(record).future

    started = time.perf_counter()
    await asyncio.gather(*(client(share) for share in shares))
    return time.perf_counter() - started


def stage_server(run: Run, rounds: int) -> None:
    from clef_flash.server.batcher import Batcher
    from clef_flash.server.metrics import ServerMetrics

    with run.stage("server batching", 90) as record:
        if record is None:
            return
        model = run.load("tiny" if run.dry_run else "random:9b-part", "bf16")
        model.state_cache.max_bytes = 0
        clients = 4 if run.dry_run else CLIENTS
        count = clients if run.dry_run else 4 * clients
        records = [model.encode(request) for request in generated_requests(model, records=count, tokens=RECORD_TOKENS, seed=7)]
        raw = {}
        for name, max_batch, wait_s in (("one at a time", 1, 0.0), ("dynamic batching", 64, 0.005)):
            metrics = ServerMetrics(lambda: 0.0, lambda: model.state_cache.stats())
            batcher = Batcher(model, metrics, batch_tokens=64 * 4096, max_batch=max_batch, batch_wait_s=wait_s)
            batcher.start()
            try:
                asyncio.run(_clients(batcher, records[:clients], clients))  # warm-up: the shapes' graphs
                raw[name] = [asyncio.run(_clients(batcher, records, clients)) for _ in range(rounds)]
            finally:
                batcher.stop()
        record["raw_seconds"] = raw
        record["records"] = len(records)
        record["clients"] = clients
        speedup = statistics.median(raw["one at a time"]) / statistics.median(raw["dynamic batching"])
        record["server_batching_speedup"] = speedup
        run.result["server_batching_speedup"] = speedup


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="every stage on tiny under the stand-in GPU (no GPU needed)")
    parser.add_argument("--out", type=Path, help="the JSON (default benchmarks/results/gpu-DATE.json; a dry run: a temp file)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for all stages; what does not fit is skipped")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--records", type=int, default=30, help="records timed one at a time (p50 / p99)")
    parser.add_argument("--requests", type=int, default=20, help="agreement requests")
    parser.add_argument("--full-int8", action="store_true", help="also the full-size 9B in int8 (quantized while loading)")
    args = parser.parse_args(argv)
    date = datetime.date.today().isoformat()
    if args.dry_run:
        from clef_flash.testing.fake_gpu import FakeGpu

        context = FakeGpu()
        rounds, records, requests_count = 1, 2, 1
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run this on a GPU machine, or `--dry-run` to check the script here", file=sys.stderr)
            return 2
        context = contextlib.nullcontext()
        rounds, records, requests_count = args.rounds, args.records, args.requests
    out = args.out or (Path(tempfile.mkdtemp()) / "gpu-dry-run.json" if args.dry_run else ROOT / "benchmarks" / "results" / f"gpu-{date}.json")
    with context as fake, tempfile.TemporaryDirectory() as scratch:
        device = fake.device if args.dry_run else torch.device("cuda")
        run = Run(device, args.budget_s, args.dry_run)
        run.result.update(
            date=date,
            commit=commit_of(),
            nvidia_smi_name=None if args.dry_run else nvidia_smi_name(),
            device_name=torch.cuda.get_device_name(0),
            torch=torch.__version__,
            dry_run=args.dry_run,
        )
        if args.dry_run:
            run.result["note"] = "dry run: the stand-in GPU (meta tensors, testing/fake_gpu.py); every figure here is meaningless"
        stage_parity_and_agreement(run, Path(scratch), requests_count)
        stage_delta_rule(run)
        stage_neighbours_and_states(run)
        stage_speed(run, rounds, records, args.full_int8)
        stage_server(run, rounds)
        if args.dry_run:
            run.result["stand_in"] = {"uploads": fake.uploads, "readbacks": fake.readbacks, "captures": fake.captures}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(run.result, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
