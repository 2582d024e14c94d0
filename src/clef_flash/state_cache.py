"""The state cache: what a record's prefix + state leaves behind, kept so that later question sets skip it.

A record is prefix + state + schema + suffix (SPEC §3), and the prefix + state tokens do not depend on the
questions. After them, the decoder's state (DeltaNet conv tails and recurrent states, attention K/V) and the
head's memory rows of those tokens are all a later record with the same prefix + state needs: it runs only
its schema and suffix. Entries are keyed by a SHA-256 of the model's identity (source, config and weights
fingerprints, precision, device) and the token ids, and kept least recently used first within a byte bound.

Memory per entry (`CachedState.nbytes`), for S state tokens:
    DeltaNet layers:  Hv·Dk·Dv·4 (recurrent, fp32) + conv_dim·(K-1)·a   bytes each, whatever S is
    attention layers: 2·Hkv·head_dim·a · S                               bytes each (K and V)
    head memory:      width·4 · S                                        bytes
with a the activation dtype's size (4 for fp32, 2 for bf16). The 9B (24 DeltaNet, 8 attention layers,
head width 1024): 48 MB + (64 KB at fp32 or 32 KB at bf16 + 4 KB) per token.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .model.qwen3_5 import DecoderState

MEBIBYTE = 1 << 20
SEEN_KEYS = 1 << 16  # keys remembered (~6 MB) to keep a short state the second time it is asked


def default_state_cache_mb() -> int:
    """An eighth of this machine's memory, at most 4 GiB: a few dozen 4K-token states of the 9B."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 << 30
    return int(min(total // 8, 4 << 30) // MEBIBYTE)


@dataclass(frozen=True)
class CachedState:
    """One row's state after `tokens` tokens, and the head's memory rows [tokens, w] of those tokens."""

    decoder: DecoderState
    memory: torch.Tensor
    tokens: int

    @property
    def nbytes(self) -> int:
        return self.decoder.nbytes + self.memory.nbytes


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0
    max_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class StateCache:
    """A least-recently-used map from state keys to `CachedState`s, never above `max_bytes` (0: off).

    Thread-safe: the server's model worker writes it while /metrics reads its counters.
    """

    def __init__(self, max_bytes: int, identity: str):
        self.identity = identity
        self._entries: OrderedDict[str, CachedState] = OrderedDict()
        self._stats = CacheStats(max_bytes=max(0, int(max_bytes)))
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def max_bytes(self) -> int:
        return self._stats.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        """A new bound; entries are evicted, least recently used first, until they fit it."""
        with self._lock:
            self._stats.max_bytes = max(0, int(value))
            self._evict(0)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def key(self, token_ids: Sequence[int], media: str | None = None, adapter: str | None = None) -> str:
        """The key of a token sequence (and of the digest of its images, if any) for this model, precision and device,
        under `adapter` (a loaded adapter's name; None: the base): a state is never shared between adapters."""
        digest = hashlib.sha256(self.identity.encode())
        digest.update(b"\0")
        digest.update(torch.tensor(list(token_ids), dtype=torch.int64).numpy().tobytes())
        if media:
            digest.update(b"\0images:" + media.encode())
        if adapter is not None:
            digest.update(b"\0adapter:" + adapter.encode())
        return digest.hexdigest()

    def get(self, key: str) -> CachedState | None:
        """The entry (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def seen(self, key: str) -> bool:
        """Whether `key` was looked at before (the last SEEN_KEYS keys); remembers it."""
        with self._lock:
            known = key in self._seen
            self._seen[key] = None
            self._seen.move_to_end(key)
            if len(self._seen) > SEEN_KEYS:
                self._seen.popitem(last=False)
            return known

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def count(self, *, hits: int = 0, misses: int = 0) -> None:
        """Records that started from a kept state (hits) and states computed (misses)."""
        with self._lock:
            self._stats.hits += hits
            self._stats.misses += misses

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of `nbytes` is kept: at most a quarter of the bound, so that one long state
        cannot flush every other."""
        return 0 < nbytes <= self.max_bytes // 4

    def put(self, key: str, entry: CachedState) -> bool:
        """Keep `entry`, evicting the least recently used until it fits; False when it can never fit."""
        size = entry.nbytes
        if not self.fits(size):
            return False
        with self._lock:
            previous = self._entries.pop(key, None)
            if previous is not None:
                self._stats.bytes -= previous.nbytes
            self._evict(size)
            self._entries[key] = entry
            self._stats.bytes += size
            self._stats.entries = len(self._entries)
            return True

    def _evict(self, room: int) -> None:
        """Drop least recently used entries until `room` more bytes fit (the lock is held)."""
        while self._entries and self._stats.bytes + room > self._stats.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._stats.bytes -= evicted.nbytes
            self._stats.evictions += 1
        self._stats.entries = len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._seen.clear()
            self._stats.bytes = self._stats.entries = 0

    @property
    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(**self._stats.as_dict())

    def __len__(self) -> int:
        return len(self._entries)
