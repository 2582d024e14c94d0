"""What this machine runs fast: CPU features, the torch build, and a short speed probe, cached.

`precision=None` (model/precision.py `choose_precision`) picks the fastest *qualified* path from
these rates. The probe times one decoder-sized product (256 tokens x 4096 -> 4096) in fp32, in bf16 and
through the W8A8 kernel (per-token quantization included), a few repetitions each, alternating, and
keeps the best of each. It takes about a second and is cached per machine (CPU model and flags), torch
build and thread count under `$CLEF_FLASH_CACHE` (default ~/.cache/clef-flash), so the choice is the
same on every load of the same machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

from .checkpoint.quant import INT_MM, ONEDNN, int_mm_linear, onednn_available, onednn_linear, onednn_pack, quantize_per_channel
from .checkpoint.vocab import cache_dir
from .model.precision import BF16

PROBE_VERSION = 1
PROBE_SHAPE = (256, 4096, 4096)  # tokens, in features, out features
FEATURE_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


@dataclass(frozen=True)
class Rates:
    """Measured multiply-accumulate rates of the probe's product, in G(FL)OP/s (2 ops per multiply-add)."""

    fp32: float
    bf16: float
    int8: float  # the faster W8A8 kernel, its activation quantization included
    int8_kernel: str  # which one: "onednn" or "int_mm" (checkpoint/quant.py)


@dataclass(frozen=True)
class Machine:
    cpu: str
    features: tuple[str, ...]  # of FEATURE_FLAGS, those this CPU has
    torch: str
    cpu_capability: str  # what ATen's CPU kernels were dispatched for (AVX2, AVX512, ...)
    onednn: bool
    threads: int

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def cpu_flags() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo; ("unknown", {}) where there is none (macOS, Windows)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown", set()
    name, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == "unknown":
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return name, flags


def this_machine() -> Machine:
    name, flags = cpu_flags()
    return Machine(
        cpu=name,
        features=tuple(flag for flag in FEATURE_FLAGS if flag in flags),
        torch=torch.__version__,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        onednn=onednn_available(),
        threads=torch.get_num_threads(),
    )


def _best_seconds(run, repeats: int) -> float:
    run()  # warm-up: allocation, packing, oneDNN's kernel choice
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _int8_runs(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    runs = {INT_MM: lambda: int_mm_linear(x, q, scale, None)}
    if onednn_available():
        packed = onednn_pack(q)
        runs[ONEDNN] = lambda: onednn_linear(x, packed, scale, None)
    return runs


def measure(repeats: int = 3, shape: tuple[int, int, int] = PROBE_SHAPE) -> Rates:
    """Time the probe's product in fp32, bf16 and through each W8A8 kernel on this CPU (best of `repeats`).

    A kernel is first tried on a product 64 times smaller: one far slower than fp32 there (a reference
    fallback, seen at 0.1 GOP/s) is left out instead of timed at full size.
    """
    tokens, inputs, outputs = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, inputs, generator=generator)
    weight = torch.randn(outputs, inputs, generator=generator) / inputs**0.5
    q, scale = quantize_per_channel(weight)
    x16, weight16 = x.to(BF16), weight.to(BF16)
    ops = 2 * tokens * inputs * outputs
    rate = lambda run: ops / _best_seconds(run, repeats) / 1e9  # noqa: E731
    fp32 = rate(lambda: x @ weight.t())
    small_x, small_q, small_scale = x[: tokens // 4, : inputs // 4], q[: outputs // 4, : inputs // 4], scale[: outputs // 4]
    small_ops = ops / 64
    full_size = _int8_runs(x, q, scale)
    int8 = {}
    for kernel, run in _int8_runs(small_x.contiguous(), small_q.contiguous(), small_scale).items():
        if small_ops / _best_seconds(run, 1) / 1e9 >= fp32 / 10:
            int8[kernel] = rate(full_size[kernel])
    kernel = max(int8, key=int8.get) if int8 else INT_MM
    return Rates(fp32=fp32, bf16=rate(lambda: x16 @ weight16.t()), int8=int8.get(kernel, 0.0), int8_kernel=kernel)


def probe_path(machine: Machine) -> Path:
    return cache_dir() / f"probe-v{PROBE_VERSION}-{machine.key}.json"


def forget_rates(machine: Machine) -> None:
    """Drop the cached probe of `machine` (file and memory): the next `rates` measures again."""
    probe_path(machine).unlink(missing_ok=True)
    rates.cache_clear()


@lru_cache(maxsize=None)
def rates(machine: Machine | None = None) -> Rates:
    """This machine's rates: from the cache file when present, else measured once and written."""
    machine = machine or this_machine()
    path = probe_path(machine)
    try:
        return Rates(**json.loads(path.read_text())["rates"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    measured = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        staging.write_text(json.dumps({"machine": asdict(machine), "rates": asdict(measured)}, indent=1))
        os.replace(staging, path)
    except OSError:
        pass  # a read-only cache: measure again next time
    return measured


def describe(machine: Machine, measured: Rates) -> dict:
    """What `clef-flash info` prints."""
    return {
        "machine": asdict(machine),
        "probe": {
            "shape": {"tokens": PROBE_SHAPE[0], "in": PROBE_SHAPE[1], "out": PROBE_SHAPE[2]},
            "fp32_gflops": round(measured.fp32, 1),
            "bf16_gflops": round(measured.bf16, 1),
            "int8_gops": round(measured.int8, 1),
            "int8_kernel": measured.int8_kernel,
        },
    }

