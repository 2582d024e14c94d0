"""Shared fixtures: the real Qwen3.5 vocabulary, and the reference oracles (SPEC §8)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

# Tests never reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load_reference_module():
    """Cloudflare's joint_schema_model.py, shipped unmodified inside clef-finetune 0.1.0."""
    spec = importlib.util.find_spec("clef_finetune")
    if spec is None or spec.origin is None:
        pytest.skip("the oracle clef-finetune is not installed (pip install --no-deps clef-finetune==0.1.0)")
    path = Path(spec.origin).parent / "_vendor" / "joint_schema_model.py"
    module_spec = importlib.util.spec_from_file_location("reference_joint_schema_model", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # dataclasses resolve annotations through sys.modules
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def reference():
    return load_reference_module()


@pytest.fixture(scope="session")
def vocab_dir(tmp_path_factory) -> Path:
    from clef_flash.testing.vocab import write_tokenizer_files

    out = tmp_path_factory.mktemp("vocab")
    write_tokenizer_files(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(vocab_dir):
    from clef_flash.tokenizer import Tokenizer

    return Tokenizer.from_file(vocab_dir)


@pytest.fixture(scope="session")
def hf_tokenizer(vocab_dir):
    """The transformers tokenizer the reference encode_record is called with."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(vocab_dir))
