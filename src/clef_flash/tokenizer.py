"""A release's `tokenizer.json`, loaded with `tokenizers` (no transformers at run time)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .errors import ModelSourceError

# The special tokens the runtime relies on, with their Qwen3.5 ids (SPEC §2).
SPECIAL_TOKEN_IDS = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<think>": 248068,
    "</think>": 248069,
}


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

    def __init__(self, backend):
        self._backend = backend
        backend.no_truncation()
        backend.no_padding()
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

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text tokenized on its own (identical to `encode` per text), in one native call."""
        return [encoding.ids for encoding in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)
