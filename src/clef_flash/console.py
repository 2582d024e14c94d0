"""What the shells print: probability bars and one progress meter (records scored, bytes converted).

The meter is a bar redrawn in place on a terminal, or a plain line every `interval` seconds when
the stream is piped (a log file gets a line per interval, not thousands of carriage returns).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 24


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    filled = round(min(max(fraction, 0.0), 1.0) * width)
    return "█" * filled + "·" * (width - filled)


def format_duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


def _amount(value: float, unit: str) -> str:
    return f"{value / 1e9:.2f} GB" if unit == "B" else f"{int(value)}"


class ProgressBar:
    """Work done out of a total, its rate and the time left, on `stream` (stderr by default).

    `unit` "B" shows bytes as GB and MB/s; any other unit is shown as a count ("records").
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
        self.total, self.label, self.unit, self.done, self.enabled = total, label, unit, done, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.interval = 0.1 if self.tty else interval
        self.start = self.last = time.perf_counter()
        self.advanced = 0.0  # by this run, for the rate

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()

    def advance(self, count: float) -> None:
        self.done += count
        self.advanced += count
        now = time.perf_counter()
        if now - self.last >= self.interval:
            self.last = now
            self._show(now)

    def finish(self) -> None:
        if not self.enabled:
            return
        self._show(time.perf_counter())
        if self.tty:
            self.stream.write("\n")
        self.enabled = False  # once

    def _show(self, now: float) -> None:
        if not self.enabled:
            return
        rate = self.advanced / max(now - self.start, 1e-9)
        left = format_duration((self.total - self.done) / rate) if rate > 0 else "?"
        fraction = self.done / self.total if self.total else 1.0
        if self.unit == "B":
            text = f"{_amount(self.done, 'B')}/{_amount(self.total, 'B')}  {rate / 1e6:.0f} MB/s  {left} left"
        else:
            text = f"{int(self.done)}/{int(self.total)} {self.unit}  {rate:.1f} {self.unit}/s  {left} left"
        if self.tty:
            self.stream.write(f"\r{bar(fraction)} {text}\x1b[K")
        else:
            self.stream.write(f"{self.label}: {text}\n")
        self.stream.flush()
