"""Fitted calibration (issue 51): the held-out ECE before and after, on a labelled set with known temperature distortions.

    python benchmarks/calibration.py [--model tiny] [--records 600] [--holdout 0.3] [--seed 1] [--label tiny]

The labels of each question are drawn from the model's own logits at a known temperature, softmax(z / T_true)
(clef_flash.testing.calibration), so the model's softmax(z) is miscalibrated by exactly T_true; then
`clef-flash eval labelled FILE --fit-calibration OUT` is run as a user runs it (the command line, in this process).
Writes benchmarks/results/calibration-LABEL.json: per question T_true and T fitted, and the held-out accuracy,
log-loss, Brier and ECE before and after, overall and per question (plus the command's report.md beside it). Not a
timing: run it niced on any machine. The tiny release's options differ by ~0.1 in logits, so its true temperatures
are small (the model underconfident); --temperatures sets others (QUESTION=T,...).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
DEFAULT_TEMPERATURES = "urgent=0.02,team=0.15,level=0.05"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a source as for --model (default tiny)")
    parser.add_argument("--records", type=int, default=600)
    parser.add_argument("--holdout", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=1, help="of the states and labels (the held-out draw: --split-seed)")
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--temperatures", default=DEFAULT_TEMPERATURES, help=f"QUESTION=T_true,... (default {DEFAULT_TEMPERATURES})")
    parser.add_argument("--label", default="tiny")
    args = parser.parse_args()

    import torch

    import clef_flash
    from clef_flash.cli import main as clef_flash_main
    from clef_flash.testing.calibration import distorted_labelled_set, write_jsonl

    torch.set_num_threads(1)
    true_temperatures = {name: float(value) for name, value in (item.split("=") for item in args.temperatures.split(","))}
    start = time.perf_counter()
    model = clef_flash.load(args.model, precision="fp32")
    lines = distorted_labelled_set(model, true_temperatures, records=args.records, seed=args.seed)
    with tempfile.TemporaryDirectory() as folder:
        labelled = write_jsonl(Path(folder) / f"distorted-{args.label}.jsonl", lines)
        out, reports = Path(folder) / "calibration.json", Path(folder) / "report"
        argv = ["eval", "labelled", str(labelled), "--model", args.model, "--precision", "fp32", "--fit-calibration", str(out)]
        code = clef_flash_main([*argv, "--holdout", str(args.holdout), "--seed", str(args.split_seed), "--out", str(reports)])
        if code:
            sys.exit(code)
        report = json.loads((reports / "report.json").read_text())
        calibration = json.loads(out.read_text())
        markdown = (reports / "report.md").read_text()
    (side,) = report["sides"]
    before, after = side["before"], side["after"]

    def figures(summary: dict) -> dict:
        return {name: round(summary[name], 4) for name in ("accuracy", "log_loss", "brier", "ece")}

    result = {
        "what": "held-out calibration before and after fitted temperatures, labels drawn at known temperatures",
        "model": report["model"],
        "records": report["records"],
        "held_out_records": report["held_out_records"],
        "holdout": args.holdout,
        "seeds": {"labels": args.seed, "split": args.split_seed},
        "questions": {
            question: {
                "true_temperature": true_temperatures[question],
                "fitted_temperature": round(side["temperatures"][question]["temperature"], 4),
                "before": figures(before["by_question"][question]),
                "after": figures(after["by_question"][question]),
            }
            for question in true_temperatures
        },
        "overall": {"before": figures(before), "after": figures(after)},
        "calibration_sha256": report["calibration"],
        "fitted_on": calibration["fitted_on"],
        "seconds": round(time.perf_counter() - start, 1),
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"calibration-{args.label}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown)
    print(json.dumps(result["overall"]), f"\nwrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
