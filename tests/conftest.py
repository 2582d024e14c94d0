"""Shared fixtures: the real Qwen3.5 vocabulary, and the reference oracles (SPEC §8)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

# The multi-node Ray tests (a head and a worker node started with `ray start`) run in a pytest process of their own:
# after tests/test_ray.py's local cluster in the same process, Ray Data's actors on the new cluster were cancelled
# before they ran (2 of 3 failed; alone they pass). `CLEF_FLASH_RAY_NODES=1 python -m pytest -q tests/test_ray_nodes.py`
# runs them; CI (.ci/run) does, after the suite.
RAY_NODES = "CLEF_FLASH_RAY_NODES"
collect_ignore = [] if os.environ.get(RAY_NODES) == "1" else ["test_ray_nodes.py"]

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


FIGURES = pytest.StashKey[list]()


def pytest_configure(config):
    config.stash[FIGURES] = []


@pytest.fixture(scope="session")
def figures(pytestconfig):
    """`figures(line)`: a parity figure shown in a section of its own at the end of the run, so that `pytest -q` (which
    captures prints) and CI's log show it."""
    return pytestconfig.stash[FIGURES].append


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(FIGURES, [])
    if lines:
        terminalreporter.section("figures")
        for line in lines:
            terminalreporter.line(line)


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory):
    """`mktemp(name)` for a module's fixtures: its folders are removed when the module's tests are done (a
    module's releases and bundles take up to 0.9 GB; with the per-test folders removed as each test passes,
    pyproject's tmp_path_retention_policy, the suite's disk stays near one module's need)."""
    made: list[Path] = []

    def mktemp(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


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
def reference_oracle(tmp_path_factory):
    """`run(release, records)`: the reference (SPEC §8) with the release's `AutoProcessor` as the reference's own
    dependencies install it (torchvision's image and video processors), fp32, on `records` ({"state", "questions",
    "images": [path, ...], "videos": [[frame path, ...] or a file's path, ...]}): per record its outputs (input_ids,
    spans, grids, logits, the processor classes) and its pixel values by key. It runs in a venv of its own (torchvision
    does not import beside this torch 2.13: `.ci/oracle-venv`, torch 2.14.1 + torchvision 0.29.1), named by
    CLEF_FLASH_ORACLE_PYTHON, as a subprocess (tests/oracle/reference.py) through a temp dir; CI builds it and sets the
    variable; where it is unset (a dev machine) the test skips, saying so."""
    import json
    import subprocess

    import numpy as np

    python = os.environ.get("CLEF_FLASH_ORACLE_PYTHON")
    script = Path(__file__).parent / "oracle" / "reference.py"

    def run(release: Path, records: list[dict]) -> list[tuple[dict, dict]]:
        if not python:
            pytest.skip(
                "CLEF_FLASH_ORACLE_PYTHON is not set: the media oracle (the reference with the release's AutoProcessor) "
                "needs its own venv with torchvision (.ci/oracle-venv DIR .venv/bin/python; CI builds it and sets the variable)"
            )
        workdir = tmp_path_factory.mktemp("oracle")
        (workdir / "spec.json").write_text(json.dumps({"release": str(release), "records": records}))
        done = subprocess.run([python, str(script), str(workdir)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"the media oracle failed:\n{done.stderr[-4000:]}"
        out = []
        for index in range(len(records)):
            keys = ("pixel_values", "pixel_values_videos")
            pixels = {key: np.load(path) for key in keys if (path := workdir / f"record{index}_{key}.npy").is_file()}
            out.append((json.loads((workdir / f"record{index}.json").read_text()), pixels))
        return out

    return run


@pytest.fixture(scope="session")
def oracle_parity():
    """`check(model, request, expected)`: `model`'s record and fp32 logits for `request` against the reference
    oracle's `expected` (one of `reference_oracle`'s outputs): token ids, spans and grids identical, images' and
    videos' pixel values within 1e-6, the same decisions and logits within 1e-5 relative; returns a line of the
    figures."""
    import numpy as np
    import torch

    def check(model, request: dict, expected: tuple[dict, dict]) -> str:
        outputs, ref_pixels = expected
        assert outputs["processors"][0] == "Qwen2VLImageProcessor", outputs["processors"]  # torchvision's, not the PIL one
        ours = model.encode(request)
        assert ours.input_ids == tuple(outputs["input_ids"])
        assert [list(q.question_span) for q in ours.questions] == outputs["question_spans"]
        assert [[list(span) for span in q.option_spans] for q in ours.questions] == outputs["option_spans"]
        grids = [list(grid) for grid in ours.media.grids]
        assert grids == outputs["image_grid_thw"] + outputs["video_grid_thw"]
        image_patches = sum(t * h * w for t, h, w in ours.media.grids[: ours.media.image_count])
        parts = {"pixel_values": ours.media.pixel_values[:image_patches], "pixel_values_videos": ours.media.pixel_values[image_patches:]}
        pixel_error = 0.0
        for key, part in parts.items():
            if key in ref_pixels or len(part):
                assert part.shape == ref_pixels[key].shape, key
                pixel_error = max(pixel_error, float(np.abs(part - ref_pixels[key]).max()))
        logits = model.logits(request)
        worst = 0.0
        for question_id, options in outputs["logits"].items():
            want = torch.tensor(list(options.values()), dtype=torch.float64)
            have = torch.tensor([logits[question_id][option] for option in options], dtype=torch.float64)
            worst = max(worst, ((have - want).abs().max() / want.abs().max()).item())
            assert max(options, key=options.get) == max(logits[question_id], key=logits[question_id].get)
        line = (
            f"{len(ours.input_ids)} tokens ({ours.media.tokens} image/video), grids {grids}, |pixel_values - ref| "
            f"{pixel_error:.1e}, logits rel {worst:.1e} (oracle processors {outputs['processors']})"
        )
        assert pixel_error <= 1e-6, line
        assert worst <= 1e-5, line
        return line

    return check


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
def kept_state_error():
    """`error(model, first, second, third)`: `second` asks other questions of `first`'s state and media, `third` the
    same state with other media of the same sizes. Scored together, only `second` may continue `first`'s kept
    state (asserted); returns the largest relative difference of `second` and `third` from each run alone."""
    from clef_flash.engine.backend import Timings

    def error(model, first: dict, second: dict, third: dict) -> float:
        records = [model.encode(request) for request in (first, second, third)]
        assert records[0].media.digest != records[2].media.digest
        model.state_cache.clear()
        timings = Timings()
        results = model.score(records, timings)
        kept = records[0].prefix_tokens + records[0].state_tokens
        assert timings.tokens_reused == kept, (timings.tokens_reused, kept)  # the second continues the first; the third never
        worst = 0.0
        for request, per_question in zip((second, third), results[1:]):
            model.state_cache.clear()
            expected = model.logits(request)
            for result in per_question:
                scale = max(abs(value) for value in expected[result.question_id].values())
                worst = max(worst, max(abs(got - expected[result.question_id][option]) for option, got in zip(result.option_ids, result.logits)) / scale)
        return worst

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
        self.answered: dict[str, dict[str, dict[str, float]]] = {}  # a request's logits, computed once per session

    def encode(self, request):
        return self.reference.encode_record(self.tokenizer, request, max_length=65_536)

    def logits(self, request) -> dict[str, dict[str, float]]:
        """The reference's logits of `request`: a function of the request alone, so the fp32 parity test and the bf16
        agreement test (tests/test_model.py) compare against one run of it (9b-heads: ~1.5 s a record)."""
        import json

        key = json.dumps(request, sort_keys=True)
        if key not in self.answered:
            self.answered[key] = self._logits(request)
        return self.answered[key]

    def _logits(self, request) -> dict[str, dict[str, float]]:
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
