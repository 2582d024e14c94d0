"""The measured agreement of each precision beside llama.cpp's formats (issue 50), as `clef-flash info` shows it.

`agreement_table.json` beside this file is made from the committed measurement
(benchmarks/results/agreement-yardsticks-A.json, `python benchmarks/agreement.py --yardsticks`) by
`python benchmarks/agreement_table.py` (`from_results`; tests/test_agreement_table.py holds it current). Per row and
per set (a random release, a seed): decisions differing from the authors' fp32 ("flips") and the median |dp| over the
reference bf16's on that set ("x"). The sets differ in hidden width; `by_width` sums a row's flips and takes its worst
ratio per width.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

TABLE = Path(__file__).with_name("agreement_table.json")
RESULTS = "benchmarks/results/agreement-yardsticks-A.json"
REFERENCE = "reference bf16"  # the reference's own bf16 path: the yardstick the ratios divide by

# key -> the row's name in the measurement (benchmarks/agreement.py `yardstick_paths` names its rows by these)
ROWS = {
    "reference-bf16": REFERENCE,
    "fp32": "ours fp32",
    "bf16": "ours bf16",
    "int8-weight-only": "int8 weight-only",
    "int8-w8a8/8": "int8 w8a8, 8-bit activations (one product: VNNI, AMX, GPU)",
    "int8-w8a8/7": "int8 w8a8, 7-bit mix (AVX2: one digit where a norm is read, two elsewhere)",
    "fp8": "fp8 e4m3 row-wise",
    "q8_0": "llama.cpp Q8_0 (emulated)",
    "q4_0": "llama.cpp Q4_0 (emulated)",
    "groups-32": "the scheme, weight groups of 32, a8 (emulated)",
    "groups-128": "the scheme, weight groups of 128, a8 (emulated)",
    "groups-256": "the scheme, weight groups of 256, a8 (emulated)",
}
YARDSTICKS = ("q8_0", "q4_0")  # what a default is shown beside


def row_key(precision: str, activation_bits: int) -> str | None:
    """The table's row of a precision as it runs here (`int8-w8a8` by its kernel's activation bits); None: not measured."""
    if precision == "int8-w8a8":
        return "int8-w8a8/8" if activation_bits >= 8 else "int8-w8a8/7"
    return precision if precision in ROWS else None


def from_results(results: dict[str, Any]) -> dict[str, Any]:
    """The shipped table from the measurement's JSON ({"runs": [...]}: benchmarks/agreement.py's)."""
    runs = results["runs"]
    return {
        "source": RESULTS,
        "sets": [
            {"config": run["config"], "seed": run["seed"], "hidden_size": run["hidden_size"], "questions": run["questions"]}
            for run in runs
        ],
        "reference_bf16_median_dp": [run["rows"][REFERENCE]["median_dp"] for run in runs],
        "rows": {
            key: {
                "name": name,
                "flips": [run["rows"][name]["decisions_differing"] for run in runs],
                "ratio": [round(run["rows"][name]["median_dp"] / run["rows"][REFERENCE]["median_dp"], 3) for run in runs],
            }
            for key, name in ROWS.items()
        },
    }


@lru_cache(maxsize=None)
def table() -> dict[str, Any]:
    return json.loads(TABLE.read_text())


def by_width(key: str, measured: dict[str, Any] | None = None) -> dict[int, tuple[int, int, float]]:
    """A row per hidden width, narrowest first: width -> (flips summed over its sets, questions, worst ratio)."""
    measured = measured or table()
    row, out = measured["rows"][key], {}
    for index, found in enumerate(measured["sets"]):
        flips, questions, worst = out.get(found["hidden_size"], (0, 0, 0.0))
        out[found["hidden_size"]] = (flips + row["flips"][index], questions + found["questions"], max(worst, row["ratio"][index]))
    return dict(sorted(out.items()))


def _figures(key: str, measured: dict[str, Any]) -> str:
    return ", ".join(f"{flips} / {ratio:.2f}x" for flips, _, ratio in by_width(key, measured).values())


def agreement_line(precision: str, activation_bits: int, measured: dict[str, Any] | None = None) -> str | None:
    """`info`'s line for a default: its row's flips and worst median |dp| ratio per width; None where the table has
    no row for it."""
    measured = measured or table()
    key = row_key(precision, activation_bits)
    if key is None:
        return None
    own = ", ".join(
        f"{flips}{' flips' if index == 0 else ''} / {worst:.2f}x at width {width} ({questions}{' questions' if index == 0 else ''})"
        for index, (width, (flips, questions, worst)) in enumerate(by_width(key, measured).items())
    )
    return f"{measured['rows'][key]['name']}: {own}"


def yardsticks_line(measured: dict[str, Any] | None = None) -> str:
    """`info`'s line under the defaults': llama.cpp's formats and the reference bf16 on the same sets, what x means."""
    measured = measured or table()
    yardsticks = "; ".join(f"{measured['rows'][key]['name'].removeprefix('llama.cpp ').removesuffix(' (emulated)')} {_figures(key, measured)}" for key in YARDSTICKS)
    reference = ", ".join(str(flips) for flips, _, _ in by_width("reference-bf16", measured).values())
    return (
        f"llama.cpp at the same widths: {yardsticks}; the reference bf16 {reference} flips (flips: decisions unlike the "
        f"authors' fp32; x: the worst median |dp| over the reference bf16's; {measured['source']})"
    )
