"""The CPU families clef-flash ships for, as the probe would measure them: tests about plan choices state one.

A test never inherits this machine's kernel by accident: it names the machine it imagines (rates, the W8A8 kernel,
its activation bits, the kernels excluded) and is parametrized over FAMILIES. Where such a test also runs a
model, `imagine` makes the plan see that family and stands the exact reference twin (checkpoint/w8a8.py
`reference_kernel`, same activation levels) in for any of its kernels that is not exact on the CPU the test
runs on, or runs there only as a reference loop: exact kernels give the same integer sums, so the answers are those the imagined CPU would give.
A test about a real kernel runs `clef_flash.machine.rates()` instead.
"""

from __future__ import annotations

import dataclasses

import clef_flash.loader
from clef_flash import machine
from clef_flash.checkpoint.w8a8 import FBGEMM, INT_MM, ONEDNN, ONEDNN_U7, W8A8_KERNELS, reference_kernel

NOT_EXACT = "not exact here: off by up to 8192768 from exact integer products on the adversarial trial"

# G(FL)OP/s of the probe's product (256 x 4096 -> 4096), 2 threads; from the machines the README names.
FAMILIES: dict[str, machine.Rates] = {
    # 8-bit kernel, fast bf16: Intel Xeon with AMX (E)
    "amx": machine.Rates(
        fp32=300, bf16=1900, int8=3000, int8_kernel=ONEDNN, kernels={ONEDNN: 3000, INT_MM: 2800, FBGEMM: 900}, int8_bits=8,
    ),
    # 8-bit kernel, no fast bf16: Ice Lake (VNNI, no bf16)
    "vnni": machine.Rates(
        fp32=130, bf16=60, int8=750, int8_kernel=ONEDNN, kernels={ONEDNN: 750, INT_MM: 700, FBGEMM: 500}, int8_bits=8,
    ),
    # 7-bit only: AMD EPYC Zen 3 (AVX2 + FMA), as measured there (issue 39): int_mm exact but a reference loop; W8A8's
    # rate there is its mixed digits' (FBGEMM 260 one digit, ~150 two: issue 40's "W8A8 as planned today" 178).
    # onednn-u7 (issue 50) was not measured on a Zen 3: its rate and both packing times are the AVX2 emulation's on
    # Zen 4 (268 against FBGEMM's 254 GOP/s, so 260 * 1.05; packing 41 against 191 ms), and it is the default's kernel
    "avx2": machine.Rates(
        fp32=123, bf16=21, int8=178, int8_kernel=ONEDNN_U7, kernels={ONEDNN_U7: 274, FBGEMM: 260, INT_MM: 4},
        excluded={ONEDNN: NOT_EXACT}, int8_bits=7, pack_ms={ONEDNN_U7: 41, FBGEMM: 191, INT_MM: 0.0},
    ),
    # no exact W8A8 kernel at all
    "none": machine.Rates(
        fp32=60, bf16=12, int8=0.0, int8_kernel=None, kernels={},
        excluded={ONEDNN: NOT_EXACT, INT_MM: NOT_EXACT, FBGEMM: "not in this torch build"},
    ),
}


def imagine(monkeypatch, family: str | machine.Rates, **changes) -> machine.Rates:
    """Make `load`'s plan (every load after this, until monkeypatch undoes it) see `family`'s probe, with
    `changes` to its rates; each of its exact kernels that is not exact on this CPU runs as its reference twin."""
    rates = FAMILIES[family] if isinstance(family, str) else family
    rates = dataclasses.replace(rates, **changes)
    measured = machine.rates()
    here = {name for name, rate in measured.kernels.items() if not machine.is_reference_loop(rate, measured.fp32)}
    for name in rates.kernels:
        if name not in here:  # not exact here, or a reference loop here (oneDNN's int8 on Zen 4: 0.2 GOP/s)
            monkeypatch.setitem(W8A8_KERNELS, name, reference_kernel(name, W8A8_KERNELS[name].levels))
    monkeypatch.setattr(clef_flash.loader, "machine_rates", lambda: rates)  # what `load` hands plan.resolve
    return rates
