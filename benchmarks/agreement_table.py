"""The int8 table beside the formats people know (issue 50): the shipped summary and the markdown, from the measurement.

    python benchmarks/agreement_table.py [RESULTS]   (default benchmarks/results/agreement-yardsticks-A.json)

Writes src/clef_flash/agreement_table.json (what `clef-flash info` shows beside the default; tests hold it current)
and RESULTS with .md for .json: per row and per set, decisions differing from the authors' fp32 / median |dp| over
the reference bf16's on that set, then per hidden width the flips summed and the worst ratio.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from clef_flash.agreement_table import RESULTS, ROWS, TABLE, by_width, from_results

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("q8_0", "q4_0", "fp8", "groups-32", "groups-128", "groups-256", "int8-w8a8/8", "int8-w8a8/7", "int8-weight-only", "bf16", "fp32")


def markdown(measured: dict) -> str:
    sets = measured["sets"]
    widths = sorted({found["hidden_size"] for found in sets})
    header = [f"{found['config']} s{found['seed']} ({found['hidden_size']}, {found['questions']} q.)" for found in sets]
    header += [f"all at {width} ({sum(found['questions'] for found in sets if found['hidden_size'] == width)} q.)" for width in widths]
    reference_cells = [f"{flips} / {dp:.2e}" for flips, dp in zip(measured["rows"]["reference-bf16"]["flips"], measured["reference_bf16_median_dp"])]
    reference_cells += [str(flips) for flips, _, _ in by_width("reference-bf16", measured).values()]
    lines = [
        "| row | " + " | ".join(header) + " |",
        "|---" * (len(header) + 1) + "|",
        "| reference bf16 (flips / median \\|dp\\|) | " + " | ".join(reference_cells) + " |",
    ]
    for key in ORDER:
        row = measured["rows"][key]
        cells = [f"{flips} / {ratio:.2f}x" for flips, ratio in zip(row["flips"], row["ratio"])]
        cells += [f"{flips} / {worst:.2f}x" for flips, _, worst in by_width(key, measured).values()]
        lines.append(f"| {row['name']} | " + " | ".join(cells) + " |")
    legend = (
        "\nflips: decisions (argmax per question) unlike the authors' fp32; x: median |dp| over the reference bf16's on "
        "the same set (per width: flips summed, the worst ratio). From benchmarks/agreement.py --yardsticks; rows "
        "emulated by benchmarks/yardsticks.py.\n"
    )
    return "\n".join(lines) + "\n" + legend


def main(results: Path) -> None:
    measured = from_results(json.loads(results.read_text()))
    assert set(measured["rows"]) == set(ROWS) == {"reference-bf16", *ORDER}
    TABLE.write_text(json.dumps(measured, indent=1) + "\n")
    results.with_suffix(".md").write_text(markdown(measured))
    print(markdown(measured))
    print(f"wrote {TABLE.relative_to(ROOT)} and {results.with_suffix('.md').relative_to(ROOT)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / RESULTS)
