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
    from clef_flash.checkpoint.vocab import write_tokenizer_files

    out = tmp_path_factory.mktemp("vocab")
    write_tokenizer_files(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(vocab_dir):
    from clef_flash.request.tokenizer import Tokenizer

    return Tokenizer.from_file(vocab_dir)


@pytest.fixture(scope="session")
def hf_tokenizer(vocab_dir):
    """The transformers tokenizer the reference encode_record is called with."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(vocab_dir))


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    from clef_flash.checkpoint.random_release import tiny_release

    return tiny_release()


@pytest.fixture(scope="session")
def vision_release(tmp_path_factory):
    """`make(name, seed, **longest_edge)`: a random `tiny-vision` release whose processors keep inputs small (each
    `preprocessor_config=N` / `video_preprocessor_config=N` caps that config's pixels after resizing), so that
    small test inputs are resized down as large ones are by the real release."""
    import json

    from clef_flash.checkpoint.random_release import write_random_release

    def make(name: str, seed: int, **longest_edge: int) -> Path:
        out = write_random_release(tmp_path_factory.mktemp(name) / "release", "tiny-vision", seed=seed)
        for config_name, pixels in longest_edge.items():
            path = out / f"{config_name}.json"
            config = json.loads(path.read_text())
            config["size"]["longest_edge"] = pixels
            path.write_text(json.dumps(config))
        return out

    return make


@pytest.fixture(scope="session")
def segments_error():
    """`error(model, request, segment_tokens)`: the largest relative difference between a request's logits run in
    segments of `segment_tokens` and in one pass (the state cache cleared before each)."""

    def error(model, request, segment_tokens: int) -> float:
        model.state_cache.clear()
        whole = model.logits(request)
        previous = model.segment_tokens
        try:
            model.segment_tokens = segment_tokens
            model.state_cache.clear()
            segmented = model.logits(request)
        finally:
            model.segment_tokens = previous
        return max(abs(segmented[q][o] - whole[q][o]) / max(abs(v) for v in whole[q].values()) for q in whole for o in whole[q])

    return error


@pytest.fixture(scope="session")
def heads_dir(tmp_path_factory) -> Path:
    """A random release with the 9B per-head sizes at hidden 256 (about 2 s to write)."""
    from clef_flash.checkpoint.random_release import write_random_release

    return write_random_release(tmp_path_factory.mktemp("release") / "9b-heads", "9b-heads", seed=1)


class ReferenceModel:
    """transformers' Qwen3_5ForConditionalGeneration + the authors' JointSchemaHead, as the reference runs them."""

    def __init__(self, reference, root: Path, dtype):
        import json

        import transformers
        from safetensors.torch import load_file

        self.reference = reference
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(root))
        backbone = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(root), dtype=dtype)
        head = reference.JointSchemaHead(**json.loads((root / "joint_head_config.json").read_text()))
        head.load_state_dict(load_file(str(root / "joint_head.safetensors")), strict=True)
        self.model = reference.ClefModel(backbone, head.to(dtype)).eval()

    def encode(self, request):
        return self.reference.encode_record(self.tokenizer, request, max_length=65_536)

    def logits(self, request) -> dict[str, dict[str, float]]:
        import torch

        encoded = self.encode(request)
        with torch.inference_mode():
            batch = self.reference.collate_records([encoded], self.tokenizer.pad_token_id, torch.device("cpu"))
            per_question = self.model(batch)[0]
        return {
            question.question_id: dict(zip(question.option_ids, values.double().tolist()))
            for question, values in zip(encoded.questions, per_question)
        }


@pytest.fixture(scope="session")
def reference_models(reference, tiny_dir, heads_dir):
    """fp32 reference models, built on first use per release name."""
    import torch

    cache: dict = {}

    def get(name: str, dtype=torch.float32) -> ReferenceModel:
        key = (name, dtype)
        if key not in cache:
            cache[key] = ReferenceModel(reference, {"tiny": tiny_dir, "9b-heads": heads_dir}[name], dtype)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models are all overhead: on a shared 2-core machine a second intra-op thread makes a
    tiny forward up to 50x slower (spinning on a busy core). The results do not depend on it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(tiny_dir, one_torch_thread):
    """tiny in fp32 on one torch thread: what the server, MCP, sets and schema tests serve (a test file that
    needs another model defines its own `model`)."""
    import clef_flash

    return clef_flash.load(tiny_dir, precision="fp32")
