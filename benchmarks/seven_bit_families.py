"""Which projections may take FBGEMM's 7-bit activations: the study behind precision.SEVEN_BIT_ONE_DIGIT.

    python benchmarks/seven_bit_families.py [--configs 9b-heads,9b-heads-outliers] [--seeds 1,2] [--json OUT]

FBGEMM (the only exact W8A8 kernel of AVX2-only CPUs) rounds activations to 7 bits. W8A8 on it runs, per family of
projections, one 7-bit digit or two (13 bits: checkpoint/w8a8.py). Rows, as benchmarks/agreement.py (same requests,
against the reference's fp32): every projection in two digits; one family at a time in one digit, the rest in two;
the MLP's inputs with attention's; every input projection in one digit (the gated products in two); the MLP's inputs
in one digit on the uncalibrated release; and the bundle's int8 weight-only, the decisions int8 weights make on
their own. The kernels are exact integer products, so the figures hold on any CPU (no need to run on AVX2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import agreement
import clef_flash
import clef_flash.checkpoint.quant as quant
import clef_flash.plan
from clef_flash.checkpoint.w8a8 import FBGEMM
from clef_flash.model.precision import TWO_DIGITS, W8A8, WEIGHT_ONLY

FAMILIES = {
    "MLP inputs": ("gate_proj", "up_proj"),
    "DeltaNet inputs": ("in_proj_qkv", "in_proj_z"),
    "attention inputs": ("q_proj", "k_proj", "v_proj"),
}


def load_in_digits(source: Path, one_digit: tuple[str, ...]):
    """W8A8 on FBGEMM with one 7-bit digit at the `one_digit` projections and two at every other."""

    def mode_of(name: str, mode: str, gated_mode: str = WEIGHT_ONLY, kernel: str | None = None) -> str:
        if mode != W8A8:
            return mode
        return W8A8 if name.rpartition(".")[2] in one_digit else TWO_DIGITS

    chosen_kernel, chosen_mode = clef_flash.plan.w8a8_kernel, quant.int8_mode_of
    clef_flash.plan.w8a8_kernel, quant.int8_mode_of = (lambda measured: FBGEMM), mode_of
    try:
        return clef_flash.load(source, device="cpu", precision="int8-w8a8")
    finally:
        clef_flash.plan.w8a8_kernel, quant.int8_mode_of = chosen_kernel, chosen_mode


def candidates(root: Path, bundle: Path, module) -> dict:
    rows = {
        "reference bf16": agreement.ReferenceModel(module, root, torch.bfloat16).logits,
        "int8 weight-only (bundle)": clef_flash.load(bundle, device="cpu", precision="int8-weight-only").logits,
        "all in two digits": load_in_digits(bundle, ()).logits,
    }
    for family, projections in FAMILIES.items():
        rows[f"one digit: {family}"] = load_in_digits(bundle, projections).logits
    rows["one digit: MLP + attention inputs"] = load_in_digits(bundle, FAMILIES["MLP inputs"] + FAMILIES["attention inputs"]).logits
    rows["one digit: every input projection"] = load_in_digits(bundle, sum(FAMILIES.values(), ())).logits
    rows["one digit: MLP inputs, uncalibrated"] = load_in_digits(root, FAMILIES["MLP inputs"]).logits
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="9b-heads,9b-heads-outliers")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    module = agreement.load_reference_module()
    results = [
        agreement.compare(config, args.requests, int(seed), module, candidates_of=candidates)
        for seed in args.seeds.split(",")
        for config in args.configs.split(",")
    ]
    for result in results:
        agreement.print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
