"""Encoding time of a typical record: ours beside the reference `encode_record`, same run.

    python benchmarks/encode.py [--repeats 200]

The reference tokenizes every prompt piece with its own transformers tokenizer call; we tokenize the
variable pieces in one batched `tokenizers` call and reuse cached ids for the fixed ones.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import median_ms, typical_request  # noqa: E402
from conftest import load_reference_module  # noqa: E402

from clef_flash.request.records import encode_record  # noqa: E402
from clef_flash.checkpoint.vocab import write_tokenizer_files  # noqa: E402
from clef_flash.request.tokenizer import Tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()

    import transformers

    vocab = Path(tempfile.mkdtemp())
    write_tokenizer_files(vocab)
    ours_tokenizer = Tokenizer.from_file(vocab)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(vocab))
    reference = load_reference_module()

    request = typical_request()
    ours = encode_record(ours_tokenizer, request)
    theirs = reference.encode_record(hf_tokenizer, request, max_length=65_536)
    assert ours.input_ids == theirs.input_ids, "encodings differ"

    ours_ms = median_ms(lambda: encode_record(ours_tokenizer, request), repeats=args.repeats)
    reference_ms = median_ms(lambda: reference.encode_record(hf_tokenizer, request, max_length=65_536), repeats=args.repeats)
    print(f"record: {ours.token_count} tokens, {len(ours.questions)} questions (identical ids)")
    print(f"reference encode_record  median {reference_ms:8.3f} ms")
    print(f"clef-flash encode_record median {ours_ms:8.3f} ms   (target <= 1 ms)")
    print(f"speed-up                        {reference_ms / ours_ms:8.1f}x  (target >= 5x)")


if __name__ == "__main__":
    main()
