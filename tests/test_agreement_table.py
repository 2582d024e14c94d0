"""The int8 table beside llama.cpp's formats (issue 50): the shipped summary is the committed measurement's, and
`clef-flash info` shows each default's row beside Q8_0's and Q4_0's, on every CPU family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clef_flash import agreement_table, machine
from clef_flash.cli import main
from cpu_families import FAMILIES

ROOT = Path(__file__).resolve().parents[1]


def test_the_shipped_table_is_the_committed_measurement():
    measured = json.loads((ROOT / agreement_table.RESULTS).read_text())
    assert agreement_table.from_results(measured) == agreement_table.table(), "run python benchmarks/agreement_table.py"
    widths = {found["hidden_size"] for found in agreement_table.table()["sets"]}
    assert len(agreement_table.table()["sets"]) >= 3 and max(widths) >= 1024  # issue 50: three sets, one wide


@pytest.mark.parametrize(
    ("family", "rows"),
    [
        ("amx", {"release": "int8-w8a8/8", "bundle": "int8-w8a8/8"}),
        ("avx2", {"release": "int8-w8a8/7", "bundle": "int8-w8a8/7"}),
        ("none", {"release": "fp32", "bundle": "int8-weight-only"}),
    ],
)
def test_info_shows_the_defaults_agreement_beside_llama_cpps(capsys, monkeypatch, family, rows):
    monkeypatch.setattr(machine, "rates", lambda machine=None: FAMILIES[family])
    report = machine.report()
    table = agreement_table.table()
    for kind, key in rows.items():
        line = report["default_agreement"][kind]
        print(f"{family} {kind}: {line}")
        assert line.startswith(table["rows"][key]["name"] + ": ")
        width, (flips, questions, worst) = next(iter(agreement_table.by_width(key).items()))
        assert f": {flips} flips / {worst:.2f}x at width {width} ({questions} questions)" in line
    for yardstick in ("Q8_0", "Q4_0"):
        flips, _, worst = agreement_table.by_width(yardstick.lower())[width]
        assert f"{yardstick} {flips} / {worst:.2f}x, " in report["agreement_yardsticks"]
    assert agreement_table.RESULTS in report["agreement_yardsticks"]
    assert main(["info"]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("agreement ")]
    assert len(printed) == len(set(rows.values())) + 1  # equal defaults print once; llama.cpp's line


def test_a_precision_the_table_does_not_measure_has_no_line():
    assert agreement_table.row_key("int8-w8a8", 7) == "int8-w8a8/7" and agreement_table.row_key("int8-w8a8", 8) == "int8-w8a8/8"
    assert agreement_table.agreement_line("fp64", 0) is None
