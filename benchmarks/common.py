"""Helpers shared by the benchmark scripts: timing, peak memory, the typical record."""

from __future__ import annotations

import resource
import statistics
import time
from typing import Callable

TICKET = (
    "Subject: Charged twice for my annual plan\n\n"
    "Hi team, I upgraded to the annual Business plan on 28 November and my card was charged twice "
    "(two payments of $1,299.00, refs 8841-AF and 8842-AF). The bank added a $35 overdraft fee. "
    "Please refund the duplicate charge and the fee. Thanks, Dana (acme-logistics)"
)


def typical_request(repeat: int = 1) -> dict:
    """A support ticket with three questions (choice, score, noul): ~370 tokens with repeat=1."""
    return {
        "model": "clef-flash",
        "state": "\n\n".join([TICKET] * repeat),
        "questions": {
            "team": {
                "type": "choice",
                "instructions": "Which team should handle this ticket?",
                "criteria": {
                    "billing": "Charges and refunds",
                    "engineering": "Bugs and outages",
                    "account": None,
                },
            },
            "urgency": {
                "type": "score",
                "instructions": "How urgent is this ticket?",
                "criteria": ["Low", "Normal", "High"],
            },
            "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        },
    }


def median_ms(function: Callable[[], object], *, repeats: int = 50, warmup: int = 3) -> float:
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
