"""What the shells print: answers as a table with probability bars, timings, and one progress meter (records
scored, bytes converted).

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


def format_timings(timings: dict[str, float]) -> str:
    return "  ".join(f"{name.removesuffix('_ms')} {value:.1f} ms" for name, value in timings.items() if name.endswith("_ms"))


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
