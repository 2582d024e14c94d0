"""The engine: encoded records -> question results, over a backend.

It decides what runs together and what is reused, the same for every backend: records are grouped into
forwards within a token budget (sorted by length: right-padding costs little); a record's prefix + state is
run once and kept (state_cache.py) when the backend can continue a state, so that records sharing it, in
one call or later ones, run only their schema and suffix. The backend (engine/backend.py) runs the
tensors: `TorchBackend` (decoder + head, segments) or `CoreMLBackend` (the packages, a record at a time).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..request.records import EncodedRecord
from ..state_cache import CachedState, StateCache
from .backend import Backend, QuestionResult, Timings

DEFAULT_BATCH_TOKENS = 8192  # padded tokens per decoder forward
# On a GPU a forward's cost grows far less than its tokens up to a few tens of thousands (the products fill the
# tensor cores from there): 64 records of ~512 tokens, the largest batch bucket (buckets.py), run as one forward.
GPU_BATCH_TOKENS = 32768
# A prefix + state this long or longer is kept on first sight (when the cache is on): running a record as
# prefix + state, then the rest, costs a second decoder step, which pays only when the state is long.
# Shorter ones are kept only when records of one call share them. Measured in README's table (issue 14).
KEEP_FROM_TOKENS = 512


def fitting(lengths: Iterable[int], budget: int, max_records: int | None = None) -> int:
    """How many records, taken in this order, one forward holds: at least one, then while the padded
    tokens (records x longest) stay within `budget` and the count within `max_records`."""
    count, longest = 0, 0
    for length in lengths:
        longest = max(longest, length)
        if count and ((max_records is not None and count >= max_records) or longest * (count + 1) > budget):
            break
        count += 1
    return count


def state_end(record: EncodedRecord) -> int:
    """Tokens of the prefix + state: what records with the same state share."""
    return record.prefix_tokens + record.state_tokens


@dataclass
class Engine:
    """Schedules records over `backend`: token budget, grouping, state reuse (the cache is `state_cache`)."""

    backend: Backend
    state_cache: StateCache
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    keep_from_tokens: int = KEEP_FROM_TOKENS

    def batches(self, records: Sequence[EncodedRecord]) -> list[list[int]]:
        """Indices of records grouped into forwards: sorted by length, each within the token budget."""
        order = sorted(range(len(records)), key=lambda index: records[index].token_count)
        return self.pack(order, [record.token_count for record in records])

    def pack(self, order: list[int], tokens: Sequence[int]) -> list[list[int]]:
        """Consecutive runs of `order` whose padded tokens fit the budget."""
        groups: list[list[int]] = []
        while order:
            count = fitting((tokens[index] for index in order), self.batch_tokens)
            groups.append(order[:count])
            order = order[count:]
        return groups

    def score(self, records: Sequence[EncodedRecord], timings: Timings | None = None) -> list[list[QuestionResult]]:
        """Logits and probabilities for every question of every encoded record.

        A record whose prefix + state is kept (cached, or shared with another record of this call) runs
        from that state; otherwise its state is kept on the way when it may be asked again (the cache is
        on and the entry fits, or another record of this call shares it). Records sharing a state are
        grouped, so a call holds at most the states of the group at hand beyond the cache. A backend that
        cannot continue a state (`state_reuse_unsupported`) runs every record whole.
        """
        timings = timings if timings is not None else Timings()
        results: list[list[QuestionResult] | None] = [None] * len(records)
        cache = self.state_cache
        # A record with images keys on their bytes too: same-size images have the same pad tokens.
        # ... and on its adapter: a fine-tune's state (its decoder's, its head's memory rows) is its own.
        keys = [
            cache.key(record.input_ids[: state_end(record)], media=record.media and record.media.digest, adapter=record.adapter)
            for record in records
        ]
        shared = Counter(keys)
        reuse = self.backend.state_reuse_unsupported is None
        keyed = [
            reuse and (shared[key] > 1 or key in cache or self._worth_keeping(key, state_end(record)))
            for key, record in zip(keys, records)
        ]
        new_tokens = [record.token_count - (state_end(record) if uses else 0) for record, uses in zip(records, keyed)]
        order = sorted(  # records sharing a state side by side; the others by length
            range(len(records)),
            key=lambda index: (keyed[index], state_end(records[index]) if keyed[index] else 0, keys[index] if keyed[index] else "", new_tokens[index]),
        )
        remaining = Counter(key for key, uses in zip(keys, keyed) if uses)
        held: dict[str, CachedState] = {}
        computed: set[str] = set()
        for group in self.pack(order, new_tokens):
            missing: dict[str, EncodedRecord] = {}  # key -> the first record of the group with it
            for index in group:
                key = keys[index]
                if keyed[index] and key not in held and key not in missing:
                    entry = cache.get(key)
                    if entry is None:
                        missing[key] = records[index]
                    else:
                        held[key] = entry
            if missing:
                held.update(self._states(missing, timings))
                computed.update(missing)
            entries = [held[keys[index]] if keyed[index] else None for index in group]
            for index, per_question in zip(group, self.backend.forward([records[index] for index in group], entries, timings)):
                results[index] = per_question
            for index in group:
                if keyed[index]:
                    remaining[keys[index]] -= 1
                    if not remaining[keys[index]]:
                        del held[keys[index]]
        state_tokens = {key: state_end(record) for key, record in zip(keys, records)}
        timings.tokens_reused += sum(state_tokens[key] for key, uses in zip(keys, keyed) if uses) - sum(
            state_tokens[key] for key in computed
        )
        cache.count(hits=sum(keyed) - len(computed), misses=len(computed))
        timings.records += len(records)
        timings.tokens += sum(record.token_count for record in records)
        return results  # type: ignore[return-value]

    def score_branches(
        self, trunk: EncodedRecord, branches: Sequence[EncodedRecord], shared: Sequence[int], timings: Timings | None = None
    ) -> list[list[QuestionResult]]:
        """The results of `trunk` and of records branching off it (explain's requests with a part left out), the
        trunk's tokens run once: `branches[i]` equals the trunk on its first `shared[i]` tokens, media included.

        The trunk's tokens run as a chain of kept states that stops at each branch point in order; each record runs
        on from its point (the trunk from the last), a token budget's worth of records per forward. N branches then
        cost the trunk's tokens once plus each record's tail, instead of N + 1 whole records (`timings.tokens_reused`
        counts the difference). A point stays within the state: the head reads the schema's own hidden states. A
        backend that cannot continue a state runs every record whole. Returns the results of [trunk, *branches].
        """
        timings = timings if timings is not None else Timings()
        records = [trunk, *branches]
        if self.backend.state_reuse_unsupported is not None:
            return self.score(records, timings)
        points = [min(point, state_end(trunk), state_end(record)) for point, record in zip([max(shared, default=0), *shared], records)]
        results: list[list[QuestionResult] | None] = [None] * len(records)
        order = sorted(range(len(records)), key=lambda index: (points[index], index))
        chain: CachedState | None = None  # the trunk's state after chain.tokens tokens
        for group in self.pack(order, [record.token_count - point for record, point in zip(records, points)]):
            kept: dict[int, CachedState] = {}
            for point in sorted({points[index] for index in group} - {0}):
                if chain is None or chain.tokens < point:
                    chain = self._run_on(trunk, chain, point, timings)
                kept[point] = chain
            entries = [kept.get(points[index]) for index in group]
            for index, per_question in zip(group, self.backend.forward([records[index] for index in group], entries, timings)):
                results[index] = per_question
        timings.tokens_reused += sum(points) - (0 if chain is None else chain.tokens)
        timings.records += len(records)
        timings.tokens += sum(record.token_count for record in records)
        return results  # type: ignore[return-value]

    def _run_on(self, record: EncodedRecord, entry: CachedState | None, tokens: int, timings: Timings) -> CachedState:
        """The record's state after its first `tokens` tokens, run on from `entry` (None: from its start)."""
        options: dict = {"entries": [entry]}
        if record.media is not None:
            options["media"] = [record.media]
        if record.adapter is not None:
            options["adapters"] = [record.adapter]
        (kept,) = self.backend.run_states([record.input_ids[:tokens]], timings, **options)
        return kept

    def _worth_keeping(self, key: str, tokens: int) -> bool:
        """Whether to keep a state this call does not share, within the cache's bound: when it is long
        enough that reusing it pays for the second decoder step it costs now (KEEP_FROM_TOKENS), or when it
        was seen before (a short state asked again is kept the second time)."""
        seen = self.state_cache.seen(key)
        return (tokens >= self.keep_from_tokens or seen) and self.state_cache.fits(self.backend.state_nbytes(tokens))

    def _states(self, records: dict[str, EncodedRecord], timings: Timings) -> dict[str, CachedState]:
        """Run the prefix + state of each record (one per key), a budget's worth at a time, and keep them."""
        keys = sorted(records, key=lambda key: state_end(records[key]))
        rows = [records[key].input_ids[: state_end(records[key])] for key in keys]
        kept: dict[str, CachedState] = {}
        for group in self.pack(list(range(len(keys))), [len(row) for row in rows]):
            media = [records[keys[index]].media for index in group]
            with_media = {"media": media} if any(item is not None for item in media) else {}
            adapters = [records[keys[index]].adapter for index in group]
            if any(name is not None for name in adapters):  # only a backend that checked them sees adapters
                with_media["adapters"] = adapters
            ran = self.backend.run_states([rows[index] for index in group], timings, **with_media)
            for index, entry in zip(group, ran):
                kept[keys[index]] = entry
                self.state_cache.put(keys[index], entry)
        return kept
