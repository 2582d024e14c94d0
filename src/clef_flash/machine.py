"""What this machine runs fast: CPU features, the torch build, and a short speed probe, cached.

`precision=None` (model/precision.py `choose_precision`) picks the fastest *qualified* path from
these rates. The probe first qualifies each W8A8 kernel (checkpoint/w8a8.py) on *exactness*: a kernel
that differs from exact integer products on the adversarial trial is excluded, whatever its speed, and
never runs (by default or forced). Then it times one decoder-sized product (256 tokens x 4096 -> 4096)
in fp32, in bf16 and through each exact W8A8 kernel as a projection runs it (the input's smoothing and rotation,
checkpoint/quant.py, and its per-token quantization included), a few repetitions
each, and keeps the best of each. It takes about a second and is cached per machine (CPU model and flags), torch
build, thread count and ISA limits (`$ONEDNN_MAX_CPU_ISA`, `$FBGEMM_ENABLE_INSTRUCTIONS`) under `$CLEF_FLASH_CACHE` (default ~/.cache/clef-flash), so the choice is the
same on every load of the same machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from .agreement_table import agreement_line, yardsticks_line
from .checkpoint.quant import quantize_per_channel
from .checkpoint.rotation import rotate
from .checkpoint.w8a8 import W8A8_KERNELS, exactness_error
from .checkpoint.vocab import cache_dir
from .model.precision import BF16, SEVEN_BIT_ONE_DIGIT_SHARE
from .plan import defaults, gpu_defaults

PROBE_VERSION = 10  # 2: kernels qualified on exactness first; the rates of every kernel, the excluded ones; 3: fp16_packed; 4: two_digit;
# 5: W8A8's kernel is the fastest exact one with 8-bit activations before any with 7; 6: the rotated scheme's W8A8
# (smoothing and rotation timed with the kernel); no fp16_packed, two_digit; 7: int8_bits; 8: a 7-bit kernel's int8 is
# its mixed digits' rate; 9: one digit at every projection that reads a norm (69% of the multiply-adds, was 47%);
# 10: onednn-u7; each kernel's packing time, and of kernels as fast as the fastest, the one that packs fastest
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS")  # env caps on kernels
PROBE_SHAPE = (256, 4096, 4096)  # tokens, in features, out features
FEATURE_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


@dataclass(frozen=True)
class Rates:
    """Measured multiply-accumulate rates of the probe's product, in G(FL)OP/s (2 ops per multiply-add)."""

    fp32: float
    bf16: float
    int8: float  # W8A8 on its kernel as the projections run it (smoothing, rotation, quantization; with 7-bit
    # activations, one digit where a norm is read and two elsewhere, weighed by their FLOPs); 0.0: none is exact
    int8_kernel: str | None  # which one (checkpoint/w8a8.py): the fastest exact one with 8-bit activations that is no
    # reference loop, else the fastest exact one; None: no kernel is exact on this machine
    kernels: dict[str, float] = field(default_factory=dict)  # every exact kernel's G(OP)/s
    excluded: dict[str, str] = field(default_factory=dict)  # kernel -> why it never runs here
    int8_bits: int = 0  # the activation bits of int8_kernel (8; 7 on FBGEMM); 0: none
    pack_ms: dict[str, float] = field(default_factory=dict)  # every exact kernel's time to pack the probe's weight


@dataclass(frozen=True)
class Machine:
    cpu: str
    features: tuple[str, ...]  # of FEATURE_FLAGS, those this CPU has
    torch: str
    cpu_capability: str  # what ATen's CPU kernels were dispatched for (AVX2, AVX512, ...)
    onednn: bool
    threads: int
    isa_limits: tuple[str, ...] = ()  # ISA_LIMITS set in the environment, as NAME=value

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
        onednn=W8A8_KERNELS["onednn"].available(),
        threads=torch.get_num_threads(),
        isa_limits=tuple(f"{name}={os.environ[name]}" for name in ISA_LIMITS if os.environ.get(name)),
    )


def _best_seconds(run, repeats: int) -> float:
    run()  # warm-up: allocation, packing, oneDNN's kernel choice
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def is_reference_loop(rate: float, fp32: float) -> bool:
    """A kernel more than 10x slower than fp32: a reference fallback (seen at 0.1 GOP/s), exact but never the default."""
    return rate < fp32 / 10


def kernel_note(name: str, gops: float, fp32: float) -> str:
    """One exact kernel's probe figure as `info` prints it: its rate, and why the default passes it over."""
    if is_reference_loop(gops, fp32):
        return f"{gops:.2g} GOP/s, a reference loop here: used only when forced"
    bits = W8A8_KERNELS[name].activation_bits
    return f"{gops:.0f} GOP/s" + ("" if bits == 8 else f", {bits}-bit activations (two digits at down_proj, o_proj, out_proj)")


AS_FAST = 0.9  # a kernel at 90% of the fastest one's rate is as fast, within the probe's noise


def w8a8_choice(kernels: dict[str, float], fp32: float, pack_ms: dict[str, float] | None = None) -> str | None:
    """W8A8's kernel among the exact ones (name -> G(OP)/s): the fastest with 8-bit activations that is no reference
    loop, else the fastest (a 7-bit one: W8A8 in mixed digits; a reference loop: too slow for the default); None: none.
    Of those as fast as the fastest (`AS_FAST`), the one that packs its weights fastest (`pack_ms`): the load waits
    for packing (on AVX2, FBGEMM's took 73% of the 9b-part's load, oneDNN's packs the same weights ~8x faster)."""
    if not kernels:
        return None
    eight_bit = [name for name in kernels if W8A8_KERNELS[name].levels == 127 and not is_reference_loop(kernels[name], fp32)]
    candidates = eight_bit or list(kernels)
    fastest = max(kernels[name] for name in candidates)
    as_fast = [name for name in candidates if kernels[name] >= AS_FAST * fastest]
    pack_ms = pack_ms or {}
    return min(as_fast, key=lambda name: (pack_ms.get(name, float("inf")), -kernels[name]))


def measure(repeats: int = 3, shape: tuple[int, int, int] = PROBE_SHAPE) -> Rates:
    """Qualify the W8A8 kernels on exactness, then time the probe's product in fp32, bf16 and through each
    exact kernel on this CPU (best of `repeats`).

    A kernel is first timed on a product 64 times smaller: one far slower than fp32 there (a reference
    fallback, seen at 0.1 GOP/s) keeps that small rate instead of being timed at full size.
    """
    tokens, inputs, outputs = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, inputs, generator=generator)
    weight = torch.randn(outputs, inputs, generator=generator) / inputs**0.5
    q, scale = quantize_per_channel(weight)
    smoothing = torch.ones(inputs)  # the input's 1 / s, folded into the rotation's signs as a projection does
    x16, weight16 = x.to(BF16), weight.to(BF16)
    ops = 2 * tokens * inputs * outputs
    rate = lambda run, ops=ops: ops / _best_seconds(run, repeats) / 1e9  # noqa: E731
    fp32 = rate(lambda: x @ weight.t())
    kernels, excluded, pack_ms = {}, {}, {}
    for kernel in W8A8_KERNELS.values():
        if not kernel.available():
            excluded[kernel.name] = "not in this torch build"
            continue
        error = exactness_error(kernel)
        if error != 0:
            excluded[kernel.name] = f"not exact here: off by up to {error:.0f} from exact integer products on the adversarial trial"
            continue
        small_x, small_q, small_scale = x[: tokens // 4, : inputs // 4].contiguous(), q[: outputs // 4, : inputs // 4].contiguous(), scale[: outputs // 4]
        packed = kernel.pack(small_q, small_scale)
        small = rate(lambda: kernel.linear(rotate(small_x, column_scale=smoothing[: inputs // 4]), packed, small_scale), ops / 64)
        if not is_reference_loop(small, fp32):
            start = time.perf_counter()
            packed = kernel.pack(q, scale)
            pack_ms[kernel.name] = (time.perf_counter() - start) * 1e3
            kernels[kernel.name] = rate(lambda: kernel.linear(rotate(x, column_scale=smoothing), packed, scale))
        else:
            kernels[kernel.name] = small  # a reference loop: exact, usable when forced, never the default
    best = w8a8_choice(kernels, fp32, pack_ms)
    int8 = kernels.get(best, 0.0)
    if best is not None and W8A8_KERNELS[best].levels < 127 and not is_reference_loop(int8, fp32):
        # 7-bit activations: W8A8 runs one digit where a norm is read, two elsewhere (precision.w8a8_digits)
        kernel = W8A8_KERNELS[best]
        packed = kernel.pack(q, scale)
        two = rate(lambda: kernel.two_digit_linear(rotate(x, column_scale=smoothing), packed, scale))
        int8 = 1 / (SEVEN_BIT_ONE_DIGIT_SHARE / int8 + (1 - SEVEN_BIT_ONE_DIGIT_SHARE) / two)
    return Rates(
        fp32=fp32,
        bf16=rate(lambda: x16 @ weight16.t()),
        int8=int8,
        int8_kernel=best,
        int8_bits=W8A8_KERNELS[best].activation_bits if best else 0,
        kernels=kernels,
        excluded=excluded,
        pack_ms=pack_ms,
    )


def probe_path(machine: Machine) -> Path:
    return cache_dir() / f"probe-v{PROBE_VERSION}-{machine.key}.json"


def forget_rates(machine: Machine) -> None:
    """Drop the cached probe of `machine` (file and memory): the next `rates` measures again."""
    probe_path(machine).unlink(missing_ok=True)
    rates.cache_clear()


@lru_cache(maxsize=None)
def rates(machine: Machine | None = None) -> Rates:
    """This machine's rates: from the cache file when present, else measured once and written (not when
    the load average exceeds the CPU count: a busy machine's figures are used for this process only)."""
    machine = machine or this_machine()
    path = probe_path(machine)
    try:
        return Rates(**json.loads(path.read_text())["rates"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    measured = measure()
    if load > (os.cpu_count() or 1):
        # Other processes held the cores: threads that spin-wait for a descheduled peer made the kernels look
        # up to 100x slower (seen: oneDNN's int8 at 1 GOP/s beside 3,000 quiet). Used now, never kept.
        return measured
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
            "int8_activation_bits": measured.int8_bits,
            "int8_kernels_gops": {name: round(value, 1) for name, value in measured.kernels.items()},
            "int8_excluded": measured.excluded,
            "int8_pack_ms": {name: round(value, 1) for name, value in measured.pack_ms.items()},
        },
    }



def report(reprobe: bool = False) -> dict:
    """What `clef-flash info` shows: `describe`, CUDA, and the default precision for a release and a bundle with why
    (plan.py `defaults`) and its measured agreement beside llama.cpp's formats; `reprobe`: measure the rates again instead of reading the cached probe."""
    here = this_machine()
    if reprobe:
        forget_rates(here)
    measured = rates(here)
    chosen = defaults(measured)
    return {
        **describe(here, measured),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "default_precision": {kind: {"precision": value.name, "why": value.reason} for kind, value in chosen.items()},
        # each default's measured agreement (agreement_table.py; None: not in the table), and llama.cpp's beside it
        "default_agreement": {kind: agreement_line(value.name, measured.int8_bits) for kind, value in chosen.items()},
        "agreement_yardsticks": yardsticks_line(),
        "cuda_default_precision": _cuda_defaults(),
        "feature_flags": FEATURE_FLAGS,  # those looked for
        "kernel_notes": {name: kernel_note(name, gops, measured.fp32) for name, gops in measured.kernels.items()},
    }


@dataclass(frozen=True)
class Gpu:
    """A CUDA device: what the default on CUDA reads (model/precision.py `choose_on_gpu`)."""

    name: str
    capability: tuple[int, int]  # (major, minor): (9, 0) is sm_90


def cuda_gpu(device: torch.device) -> Gpu | None:
    """The one place a CUDA device's name and compute capability are read (tests hand `resolve` their own);
    None: not a CUDA device, or none here."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return Gpu(torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device)))


def _cuda_defaults() -> dict | None:
    """The plan on this machine's CUDA device (engine/graphs.py captures its steps, buckets.py shapes them); None
    without one."""
    found = cuda_gpu(torch.device("cuda"))
    if found is None:
        return None
    return {kind: {"precision": value.name, "why": value.reason} for kind, value in gpu_defaults(found).items()}


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def available_memory_bytes() -> int | None:
    """Memory a new model may take now: MemAvailable from /proc/meminfo (Linux), else the physical memory;
    None where neither is known."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
