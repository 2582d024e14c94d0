"""The tokenizer's fast path gives the backend's ids on every input (its slow twin is the backend)."""

from __future__ import annotations

import itertools
import re
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clef_flash.request import tokenizer as tokenizer_module
from clef_flash.request.tokenizer import ASCII_SPLIT_PATTERN, QWEN3_5_SPLIT_PATTERN, SPECIAL_TOKEN_IDS, Tokenizer

COMPARED: dict[str, int] = {}  # texts compared (and found equal), by test

ASCII = [chr(code) for code in range(128)]
TRICKY = list("\t\n\x0b\x0c\r \x1c\x1d\x1e\x1f\x00\x7f'\"`sStTlLrReEvVmMdDa1 0.,!?-_<>|/\\{}[]()#$")
CORE = list("\t\n\x0b\x0c\r \x1c\x1f\x00'\"sSlLeEdDa10.,!-<>|")  # for the exhaustive triples
SPECIAL_PIECES = ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<think>", "</think>", "<|im_", "<|", "|>", "<", "think>"]
NON_ASCII = [
    "é", "e\u0301", "A\u030a", "Å", "=\u0338", "<\u0338", ">\u0338", "\u0338", "\u0301", "’", "“", "—",
    "\xa0", "\x85", "\u2028", "\u3000", "\u1680", "😀", "🇫🇷", "東京", "\u1100\u1161\u11a8", "ﬁ", "\u037e",
    "\u1fef", "ß", "ſ", "\u212a", "٣", "Ⅻ", "\u200b", "\ufeff",
]


@pytest.fixture(autouse=True)
def cut_at_every_safe_cut(monkeypatch):
    """Cut text with non-ASCII characters wherever it is safe, however little that saves (to test the cuts)."""
    monkeypatch.setattr(tokenizer_module, "ASCII_CHARS_PER_BACKEND_CALL", 0)


@pytest.fixture(scope="module")
def backend(vocab_dir):
    """A separate plain `tokenizers` backend: the slow, obviously-correct twin."""
    from tokenizers import Tokenizer as Backend

    return Backend.from_file(str(vocab_dir / "tokenizer.json"))


def assert_same(tokenizer, backend, texts, name):
    """Our encode_batch and encode equal the backend's ids for every text."""
    texts = list(texts)
    expected = [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]
    batched = tokenizer.encode_batch(texts)
    for text, mine, theirs in zip(texts, batched, expected):
        assert mine == theirs, f"encode_batch differs on {text!r}"
    for text, theirs in zip(texts, expected):
        assert tokenizer.encode(text) == theirs, f"encode differs on {text!r}"
    COMPARED[name] = COMPARED.get(name, 0) + len(texts)


def test_fast_path_is_on_for_the_qwen35_tokenizer(tokenizer):
    assert tokenizer.fast_path, tokenizer.fast_path_blocker
    assert tokenizer.fast_path_blocker is None


def test_split_pattern_is_qwen_tokenizers():
    from clef_flash.checkpoint.vocab import split_pattern

    assert QWEN3_5_SPLIT_PATTERN == split_pattern()


def test_ascii_byte_level_table_is_gpt2s():
    from clef_flash.checkpoint.vocab import _byte_to_unicode

    expected = {byte: char for byte, char in _byte_to_unicode().items() if byte < 128}
    assert tokenizer_module._ascii_byte_level() == expected


def test_ascii_pattern_covers_every_ascii_text_without_gaps():
    # The backend's `isolated` split keeps unmatched stretches; findall would drop them, so none may exist.
    pattern = re.compile(ASCII_SPLIT_PATTERN)
    for char in ASCII:
        assert pattern.match(char), repr(char)
    for first, second in itertools.product(ASCII, repeat=2):
        assert "".join(pattern.findall(first + second)) == first + second


def test_nfc_never_composes_onto_an_ascii_character():
    # The premise of the safe cuts: no canonical decomposition has an ASCII character after its first.
    for code in range(0x110000):
        decomposition = unicodedata.decomposition(chr(code))
        if decomposition and not decomposition.startswith("<"):
            assert all(int(part, 16) >= 128 for part in decomposition.split()[1:]), hex(code)
    assert all(unicodedata.combining(char) == 0 for char in ASCII)


def test_every_ascii_character_and_pair(tokenizer, backend):
    assert_same(tokenizer, backend, ASCII, "ascii singles")
    assert_same(tokenizer, backend, ("".join(pair) for pair in itertools.product(ASCII, repeat=2)), "ascii pairs")


def test_tricky_triples(tokenizer, backend):
    assert_same(tokenizer, backend, ("".join(t) for t in itertools.product(CORE, repeat=3)), "tricky triples")


def test_contractions_in_every_case(tokenizer, backend):
    forms = ["".join(cased) for word in ["s", "t", "re", "ve", "m", "ll", "d", "x"] for cased in
             itertools.product(*[(c.lower(), c.upper()) for c in word])]
    texts = []
    for form in forms:
        for before, after in itertools.product(["", "I", "we", " ", "\n", "'", "1", "é", "<|im_end|>"], ["", "x", " ", "'", "s", "\n", "é"]):
            texts.append(f"{before}'{form}{after}")
    assert_same(tokenizer, backend, texts, "contractions")


def test_special_tokens_inside_text(tokenizer, backend):
    texts = [
        "".join(parts)
        for parts in itertools.product(["", "a", " ", "\n", "é", "x."], SPECIAL_PIECES, ["", "b", " ", "\n\n", "’"], SPECIAL_PIECES)
    ]
    assert_same(tokenizer, backend, texts, "special pieces")
    assert tokenizer.encode("<|im_end|>") == [SPECIAL_TOKEN_IDS["<|im_end|>"]]


def test_non_ascii_next_to_safe_cuts(tokenizer, backend):
    contexts = ["a", "1", "a ", "a.", "1,", "a\n", "a \n", ". ", "'", " ", "\n", "=", "<", ""]
    texts = ["".join(parts) for parts in itertools.product(contexts, NON_ASCII, contexts)]
    texts += ["".join(parts) for parts in itertools.product(["x", "x ", "x="], ["", "a", "1"], NON_ASCII)]
    assert_same(tokenizer, backend, texts, "non-ascii contexts")


def test_cutting_threshold_keeps_short_ascii_stretches_whole(tokenizer, backend, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "ASCII_CHARS_PER_BACKEND_CALL", 24)
    assert tokenizer._fast.chunks("Zoë said hi") == ["Zoë said hi"]
    long_ascii = "The card was charged twice, please refund it. " * 3
    chunks = tokenizer._fast.chunks(long_ascii + "Zoë")
    assert chunks[-1] == ". Zoë" and all(isinstance(chunk, list) for chunk in chunks[:-1])
    texts = [long_ascii + "Zoë", "Zoë said hi", "’" + long_ascii, long_ascii + "é" + long_ascii + "😀" + long_ascii]
    assert_same(tokenizer, backend, texts, "default threshold")


def test_batch_mixes_fast_and_backend_texts(tokenizer, backend):
    texts = ["", "plain ascii", "naïve café", "", "<|im_end|>é<think>", "東京", "x" * 300, "y’all\n\n  end  "]
    assert_same(tokenizer, backend, texts, "batch")
    assert tokenizer.encode_batch([]) == []


def test_word_cache_stays_bounded(tokenizer, backend, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "WORD_CACHE_SIZE", 8)
    tokenizer._fast._word_ids.clear()
    texts = [" ".join(f"w{i}x{j}" for j in range(20)) for i in range(10)] + ["z" * 200, "z" * 200 + " q"]
    assert_same(tokenizer, backend, texts, "bounded cache")
    assert len(tokenizer._fast._word_ids) <= 8
    assert "z" * 200 not in tokenizer._fast._word_ids  # longer than WORD_CACHE_MAX_CHARS


HEALTH = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# Weighted toward the tricky characters: two draws in three are one of them.
tricky_ascii = st.lists(
    st.one_of(st.sampled_from(TRICKY), st.sampled_from(TRICKY), st.sampled_from(["hello", "I'M", "'ll", "12", "  ", "\r\n"] + SPECIAL_PIECES)),
    max_size=40,
).map("".join)
any_ascii = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127), max_size=80)
mixed = st.lists(st.sampled_from(TRICKY + SPECIAL_PIECES + NON_ASCII + ["word", " word", "42", "I'm"]), max_size=25).map("".join)


@settings(max_examples=2500, **HEALTH)
@given(tricky_ascii)
def test_generated_tricky_ascii(tokenizer, backend, text):
    assert_same(tokenizer, backend, [text], "generated tricky ascii")


@settings(max_examples=1500, **HEALTH)
@given(any_ascii)
def test_generated_ascii(tokenizer, backend, text):
    assert_same(tokenizer, backend, [text], "generated ascii")


@settings(max_examples=1500, **HEALTH)
@given(st.text(max_size=80))
def test_generated_unicode(tokenizer, backend, text):
    assert_same(tokenizer, backend, [text], "generated unicode")


@settings(max_examples=1500, **HEALTH)
@given(mixed)
def test_generated_mixed_text_with_special_tokens(tokenizer, backend, text):
    assert_same(tokenizer, backend, [text], "generated mixed")


@settings(max_examples=300, **HEALTH)
@given(st.lists(st.sampled_from(TRICKY + SPECIAL_PIECES + NON_ASCII + ["word", " word", "42", "I'm", "\n\n"] * 4), max_size=200).map("".join))
def test_generated_long_mixed_text(tokenizer, backend, text):
    assert_same(tokenizer, backend, [text], "generated long mixed")


@settings(max_examples=300, **HEALTH)
@given(st.lists(st.one_of(tricky_ascii, mixed, st.text(max_size=30)), max_size=8))
def test_generated_batches(tokenizer, backend, texts):
    assert_same(tokenizer, backend, texts, "generated batches")


# A tiny byte-level BPE with the Qwen3.5 structure, to check what switches the fast path off.
def tiny_backend():
    from tokenizers import Regex
    from tokenizers import Tokenizer as Backend
    from tokenizers import normalizers, pre_tokenizers
    from tokenizers.models import BPE

    from clef_flash.checkpoint.vocab import _byte_to_unicode

    byte_chars = _byte_to_unicode()
    vocab = {byte_chars[byte]: byte for byte in range(256)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "in"), ("'", "s")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Backend(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.add_special_tokens(list(SPECIAL_TOKEN_IDS))
    return backend


def test_tiny_qwen_shaped_tokenizer_takes_the_fast_path():
    backend = tiny_backend()
    tokenizer = Tokenizer(backend)
    assert tokenizer.fast_path, tokenizer.fast_path_blocker
    assert_same(tokenizer, tiny_backend(), ["in the thin tin's<|im_end|>theme", "the\n\n  é't", ""], "tiny")


def test_overlapping_added_tokens_match_leftmost_longest():
    backend = tiny_backend()
    backend.add_special_tokens(["<a>", "<a><b>", "b><", "<a><b>c"])
    twin = tiny_backend()
    twin.add_special_tokens(["<a>", "<a><b>", "b><", "<a><b>c"])
    tokenizer = Tokenizer(backend)
    assert tokenizer.fast_path, tokenizer.fast_path_blocker
    pieces = ["<a>", "<b>", "b><", "c", "<", "é", " "]
    assert_same(tokenizer, twin, ["".join(parts) for parts in itertools.product(pieces, repeat=4)], "overlapping added tokens")


def _without_normalizer(backend):
    backend.normalizer = None


def _nfkc(backend):
    from tokenizers import normalizers

    backend.normalizer = normalizers.NFKC()


def _nfc_in_a_sequence(backend):
    from tokenizers import normalizers

    backend.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])


def _pre_tokenizer(split_pattern=QWEN3_5_SPLIT_PATTERN, behavior="isolated", **byte_level):
    def change(backend):
        from tokenizers import Regex, pre_tokenizers

        options = dict(add_prefix_space=False, use_regex=False) | byte_level
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split_pattern), behavior=behavior), pre_tokenizers.ByteLevel(**options)]
        )

    return change


def _byte_level_only(backend):
    from tokenizers import pre_tokenizers

    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _dropout(backend):
    backend.model.dropout = 0.1


def _normalized_added_token(backend):
    from tokenizers import AddedToken

    backend.add_tokens([AddedToken("hello", normalized=True)])


def _lstrip_added_token(backend):
    from tokenizers import AddedToken

    backend.add_special_tokens([AddedToken("<x>", lstrip=True, normalized=False)])


def _encode_special_tokens(backend):
    backend.encode_special_tokens = True


def _template_post_processor(backend):
    from tokenizers import processors

    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", backend.token_to_id("<|im_start|>"))])


OTHER_STRUCTURES = {
    "normalizer removed": _without_normalizer,
    "NFKC normalizer": _nfkc,
    "NFC inside a sequence": _nfc_in_a_sequence,
    "pattern without \\p{M}": _pre_tokenizer(QWEN3_5_SPLIT_PATTERN.replace("\\p{M}", "")),
    "GPT-2 pattern": _pre_tokenizer(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"),
    "split behavior removed": _pre_tokenizer(behavior="removed"),
    "byte level with prefix space": _pre_tokenizer(add_prefix_space=True),
    "byte level with its own regex": _pre_tokenizer(use_regex=True),
    "byte level alone": _byte_level_only,
    "BPE dropout": _dropout,
    "normalized added token": _normalized_added_token,
    "lstrip added token": _lstrip_added_token,
    "encode_special_tokens": _encode_special_tokens,
    "template post-processor": _template_post_processor,
}


@pytest.mark.parametrize("name", list(OTHER_STRUCTURES))
def test_other_structures_switch_the_fast_path_off(name):
    backend = tiny_backend()
    OTHER_STRUCTURES[name](backend)
    tokenizer = Tokenizer(backend)
    print(f"\n{name}: {tokenizer.fast_path_blocker}")
    assert not tokenizer.fast_path and tokenizer.fast_path_blocker
    if name != "BPE dropout":  # dropout is random: nothing to compare
        text = "in the thin tin's hello<x> <|im_end|>x"
        assert tokenizer.encode(text) == backend.encode(text, add_special_tokens=False).ids


def test_fast_path_can_be_switched_off(backend):
    tokenizer = Tokenizer(backend, fast_path=False)
    assert not tokenizer.fast_path and tokenizer.fast_path_blocker == "switched off"


def test_compared_counts():
    # Runs last (file order).
    total = sum(COMPARED.values())
    print("\nfast path vs backend: " + ", ".join(f"{name} {count}" for name, count in COMPARED.items()) + f"; {total} texts, 0 differences")
    assert COMPARED.get("generated tricky ascii", 0) >= 2000
