"""What the shells print: answers as a table with probability bars, explanations as a table per question, timings,
and one progress meter (records scored, bytes converted).

The meter is tqdm's: a bar redrawn in place on a terminal; when the stream is piped, tqdm's line
every `interval` seconds, each on a line of its own (a log file gets a line per interval, not
thousands of carriage returns).
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm

BAR_WIDTH = 24


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    filled = round(min(max(fraction, 0.0), 1.0) * width)
    return "█" * filled + "·" * (width - filled)


def format_answers(body: dict[str, Any], *, random_weights: bool) -> str:
    """A System One response body as a readable table: each answer, and a bar per option."""
    lines = []
    if random_weights:
        lines.append("(random weights: these answers mean nothing; use --model Cloudflare/clef-flash for the real model)")
    for question_id, answer in body["answers"].items():
        kind = answer["type"]
        if kind == "noul":
            p_true = answer["noul"]
            verdict = "yes" if p_true >= 0.5 else "no"
            lines.append(f"{question_id}  (noul)  -> {verdict}")
            probabilities = {"true": p_true, "false": round(1 - p_true, 4)}
        elif kind == "choice":
            lines.append(f"{question_id}  (choice)  -> {answer['choice']}  (confidence {answer['confidence']:.4f})")
            probabilities = answer["probabilities"]
        else:
            lines.append(f"{question_id}  (score)  -> {answer['score']:.4f}  (confidence {answer['confidence']:.4f})")
            probabilities = {f"{level} {answer['legend'][level]}": p for level, p in answer["probabilities"].items()}
        width = max(len(str(option)) for option in probabilities)
        for option, probability in probabilities.items():
            lines.append(f"    {str(option):<{width}}  {bar(probability)}  {probability:.4f}")
    lines.append(f"input tokens: {body['usage']['input_tokens']}")
    return "\n".join(lines)


EXPLAIN_OPTIONS_SHOWN = 4  # option columns per question (the decision first, then the most probable); --json has all


def format_explanation(body: dict[str, Any], *, random_weights: bool) -> str:
    """An explanation (`Explanation.to_dict()`) as a table per question: a row per part, its contribution to the
    decision and the most probable other options, and a bar of its contribution to the decision."""
    lines = []
    if random_weights:
        lines.append("(random weights: these contributions mean nothing; use --model Cloudflare/clef-flash for the real model)")
    meaning = (
        "p(option) - p(option with the part left out)" if body["method"] == "leave-out" else "the part's token attributions, summed"
    )
    lines.append(f"{body['method']}: {len(body['parts'])} parts; a contribution is {meaning}")
    labels = [f"{part['label']}  {part['excerpt']}" for part in body["parts"]]
    labels = [label if len(label) <= 44 else label[:43] + "…" for label in labels]
    width = max(map(len, labels))
    for question_id, question in body["questions"].items():
        options = question["options"]
        decision = question["decision"]
        lines.append("")
        lines.append(f"{question_id}  ({question['type']})  -> {decision}  (p {options[decision]['probability']:.4f})")
        others = sorted((name for name in options if name != decision), key=lambda name: -options[name]["probability"])
        shown = [decision] if question["type"] == "noul" else [decision, *others][:EXPLAIN_OPTIONS_SHOWN]
        names = [name if len(name) <= 10 else name[:9] + "…" for name in shown]
        lines.append(f"    {'part':<{width}}  " + "  ".join(f"{name:>10}" for name in names))
        scale = max((abs(value) for value in options[decision]["contributions"]), default=0.0) or 1.0
        for index, label in enumerate(labels):
            values = "  ".join(f"{options[name]['contributions'][index]:>+10.4f}" for name in shown)
            value = options[decision]["contributions"][index]
            lines.append(f"    {label:<{width}}  {values}  {'+' if value >= 0 else '-'}{bar(abs(value) / scale, 16)}")
        if len(shown) < len(options) and question["type"] != "noul":
            lines.append(f"    ({len(options) - len(shown)} more options: --json has them all)")
    cost = body["cost"]
    ratio = cost["tokens_run"] / max(cost["tokens_whole"], 1)
    lines.append("")
    lines.append(
        f"cost: {cost['records']} records, {cost['tokens_run']:,} decoder tokens run of {cost['tokens_whole']:,} as whole "
        f"records ({ratio:.2f}x), {cost['passes']} passes, {cost['milliseconds']:,.0f} ms"
    )
    return "\n".join(lines)


def format_timings(timings: dict[str, float]) -> str:
    return "  ".join(f"{name.removesuffix('_ms')} {value:.1f} ms" for name, value in timings.items() if name.endswith("_ms"))


def calibration_lines(described: dict[str, Any]) -> list[str]:
    """A calibration's lines in `info` (calibration.Calibration.describe)."""
    fitted = described["fitted_on"]
    on = ", ".join(f"{key} {fitted[key]}" for key in ("file", "records", "source", "precision", "created") if key in fitted)
    sides = {"base": described["base_questions"], **described.get("adapter_questions", {})}
    return [
        f"calibration  {described.get('path', '')} (sha256 {described['sha256']}), fitted on {on or 'unknown'}",
        *(f"             {side}: {len(questions)} questions tempered ({', '.join(questions) or 'none'})" for side, questions in sides.items()),
    ]


def _kinds_by_line(lines: dict[str, str | None]) -> dict[str, list[str]]:
    """kind -> line (None: none) as line -> the kinds that share it, so equal defaults print once."""
    shared: dict[str, list[str]] = {}
    for kind, line in lines.items():
        if line is not None:
            shared.setdefault(line, []).append(kind)
    return shared


def format_machine(report: dict[str, Any]) -> str:
    """`clef-flash info`'s lines from machine.py's `report`."""
    here, probe, shape = report["machine"], report["probe"], report["probe"]["shape"]
    features = ", ".join(here["features"]) or "none of " + ", ".join(report["feature_flags"])
    onednn = "yes" if here["onednn"] else "no"
    lines = [
        f"CPU          {here['cpu']} ({features})",
        f"torch        {here['torch']}, kernels for {here['cpu_capability']}, oneDNN {onednn}, {here['threads']} threads",
        f"CUDA         {report['cuda'] or 'none'}",
        f"probe        fp32 {probe['fp32_gflops']:.0f} GFLOP/s, bf16 {probe['bf16_gflops']:.0f} GFLOP/s, int8 {probe['int8_gops']:.0f} "
        f"GOP/s ({probe['int8_kernel']}); {shape['tokens']} tokens x {shape['in']} -> {shape['out']}",
        *(f"W8A8 kernel  {name}: exact here, {note}" for name, note in report["kernel_notes"].items()),
        *(f"W8A8 kernel  {name}: excluded, {why}" for name, why in probe["int8_excluded"].items()),
        *(f"default      {kind}: {value['precision']} ({value['why']})" for kind, value in report["default_precision"].items()),
        *(f"agreement    {' and '.join(kinds)}: {line}" for line, kinds in _kinds_by_line(report.get("default_agreement", {})).items()),
        *([f"agreement    {report['agreement_yardsticks']}"] if report.get("agreement_yardsticks") else []),
        *(
            f"on CUDA      {kind}: {value['precision']} ({value['why']}); sequence buckets and CUDA graphs"
            for kind, value in (report.get("cuda_default_precision") or {}).items()
        ),
        *(f"adapter      {item['name']}: rank {item['rank']}, {item['projections']} projections, {item['bytes'] / 2**20:.1f} MiB "
          f"({item['path']})" for item in report.get("adapters", [])),
        *(calibration_lines(report["calibration"]) if "calibration" in report else ()),
    ]
    return "\n".join(lines)


class _Lines:
    """A stream for tqdm off a terminal: its carriage-return redraws become one line each."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


class ProgressBar:
    """Work done out of a total, its rate and the time left, on `stream` (stderr by default).

    `unit` "B" shows bytes (kB, MB, GB, and their rate); any other unit is shown as a count ("records").
    `done` is work already done before this run (a resumed job): the rate counts only this run's.
    """

    def __init__(
        self,
        total: float,
        label: str,
        *,
        unit: str = "records",
        done: float = 0,
        stream: TextIO | None = None,
        interval: float = 10.0,
        enabled: bool = True,
    ):
        stream = stream if stream is not None else sys.stderr
        tty = stream.isatty()
        in_bytes = unit == "B"
        self.meter = tqdm(
            total=total,
            initial=done,
            desc=label,
            unit=unit if in_bytes else f" {unit}",
            unit_scale=in_bytes,
            unit_divisor=1000,
            file=stream if tty else _Lines(stream),
            mininterval=0.1 if tty else interval,
            dynamic_ncols=tty,
            ncols=None if tty else 100,
            ascii=None if tty else True,
            smoothing=0.1,
            disable=not enabled,
            leave=True,
        )

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()

    def advance(self, count: float) -> None:
        self.meter.update(count)

    def finish(self) -> None:
        self.meter.close()  # once: tqdm ignores a second close
