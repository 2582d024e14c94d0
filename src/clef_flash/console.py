"""What the shells print: probability bars, and one progress meter (records scored, bytes converted).

The meter is tqdm's: a bar redrawn in place on a terminal; when the stream is piped, tqdm's line
every `interval` seconds, each on a line of its own (a log file gets a line per interval, not
thousands of carriage returns).
"""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

BAR_WIDTH = 24


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    filled = round(min(max(fraction, 0.0), 1.0) * width)
    return "█" * filled + "·" * (width - filled)


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
