"""Generated System One requests for parity tests and benchmarks (deterministic for a seed)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

WORDS = (
    "account billing card charged twice refund invoice plan upgrade seats login password reset error outage "
    "page slow crash mobile app order shipped late missing package address customer urgent today please "
    "thanks help team manager contract renewal discount price quote trial cancel delete data export report "
    "bug feature request integration api token webhook timeout server database backup restore region latency"
).split()
UNICODE_WORDS = ("café", "naïve", "東京", "Привет", "😀", "Zürich", "señor", "Ελλάδα")


def _sentence(rng: random.Random, words: int) -> str:
    chosen = [rng.choice(WORDS) if rng.random() > 0.05 else rng.choice(UNICODE_WORDS) for _ in range(words)]
    return " ".join(chosen).capitalize() + rng.choice([".", "!", "?", "."])


def random_state(rng: random.Random, words: int) -> Any:
    """Text most of the time; sometimes a JSON object or list with the same amount of text."""
    kind = rng.random()
    if kind < 0.7:
        return " ".join(_sentence(rng, rng.randint(5, 15)) for _ in range(max(1, words // 10)))
    if kind < 0.9:
        return {
            "subject": _sentence(rng, 6),
            "body": _sentence(rng, max(1, words - 6)),
            "priority": rng.randint(1, 5),
            "tags": [rng.choice(WORDS) for _ in range(3)],
            "vip": rng.random() < 0.3,
        }
    return [_sentence(rng, max(1, words // 3)) for _ in range(3)]


def random_question(rng: random.Random, *, options: int | None = None) -> dict[str, Any]:
    kind = rng.choice(["noul", "choice", "score"]) if options is None else "choice"
    instructions = rng.choice([_sentence(rng, rng.randint(3, 10)), None, {"ask": _sentence(rng, 4)}])
    question: dict[str, Any] = {"type": kind}
    if instructions is not None:
        question["instructions"] = instructions
    if kind == "noul":
        if rng.random() < 0.3:
            question["criteria"] = {"true": _sentence(rng, 4), "false": _sentence(rng, 4)}
    elif kind == "choice":
        count = options if options is not None else rng.randint(2, 6)
        labels = rng.sample(WORDS, count) if count <= len(WORDS) else [f"option_{i}" for i in range(count)]
        question["criteria"] = {label: (_sentence(rng, 3) if rng.random() < 0.7 else None) for label in labels}
    else:
        question["criteria"] = [_sentence(rng, 2) for _ in range(rng.randint(2, 5))]
    return question


def random_request(
    rng: random.Random, *, state_words: int = 60, questions: int | None = None, options: int | None = None
) -> dict[str, Any]:
    count = questions if questions is not None else rng.randint(1, 4)
    return {
        "model": "clef-flash",
        "state": random_state(rng, state_words),
        "questions": {
            f"q{index}_{rng.choice(WORDS)}": random_question(rng, options=options if index == 0 else None)
            for index in range(count)
        },
    }


def random_requests(seed: int, count: int, *, state_words: tuple[int, int] = (5, 120)) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_request(rng, state_words=rng.randint(*state_words)) for _ in range(count)]


def request_of_tokens(count_tokens: Callable[[dict[str, Any]], int], tokens: int, seed: int = 0) -> dict[str, Any]:
    """A generated request (three questions) whose state of random words is padded to the most
    words that keep the rendered record within `tokens` tokens (`count_tokens(request)` renders it);
    when the questions alone take more, the state is one word."""
    rng = random.Random(seed)
    request = random_request(rng, questions=3)
    words: list[str] = []

    def with_words(count: int) -> dict[str, Any]:
        while len(words) < count:
            words.append(rng.choice(WORDS))
        return {**request, "state": " ".join(words[:count])}

    low, high = 1, 2  # low fits (or is the floor); find a high that does not fit, then bisect
    while count_tokens(with_words(high)) <= tokens:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if count_tokens(with_words(middle)) <= tokens else (low, middle)
    return with_words(low)
