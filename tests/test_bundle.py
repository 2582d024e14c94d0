"""The 8-bit bundle: conversion, the manifest, memory-mapped loading, refusals, and int8 agreement with fp32."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import clef_flash
from clef_flash.checkpoint import bundle as bundle_module
from clef_flash.checkpoint import safetensors_io
from clef_flash.checkpoint.bundle import FORMAT, FORMAT_VERSION, MANIFEST, convert
from clef_flash.checkpoint.safetensors_io import MappedSafetensors, sha256_of
from clef_flash.model.precision import is_quantized
from clef_flash.cli import main
from clef_flash.errors import BundleError, ClefError, ModelSourceError
from clef_flash.request.samples import random_requests


@pytest.fixture(scope="module")
def bundle_dir(tiny_dir, module_tmp):
    return convert(tiny_dir, module_tmp("bundle") / "tiny-int8", progress=False)


def copy_of(bundle_dir, tmp_path):
    return shutil.copytree(bundle_dir, tmp_path / "copy")


def test_manifest_describes_every_file_and_tensor(bundle_dir, tiny_dir):
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    assert manifest["format"] == FORMAT and manifest["format_version"] == FORMAT_VERSION
    assert manifest["precision"] == "int8" and "per output channel" in manifest["scheme"]["weights"]
    assert manifest["config"] == json.loads((tiny_dir / "config.json").read_text())
    assert manifest["source"]["config_sha256"] == clef_flash.checkpoint.sources.config_fingerprint(manifest["config"])
    on_disk = {path.name for path in bundle_dir.iterdir()}
    assert on_disk == set(manifest["files"]) | {MANIFEST}
    for name, entry in manifest["files"].items():
        assert (bundle_dir / name).stat().st_size == entry["bytes"]
        assert sha256_of(bundle_dir / name) == entry["sha256"]
    held = {}
    for name in manifest["files"]:
        if name.endswith(".safetensors"):
            held.update({tensor: name for tensor in MappedSafetensors(bundle_dir / name).keys()})
    assert held == {name: entry["file"] for name, entry in manifest["tensors"].items()}
    decoder = [name for name in manifest["tensors"] if name.startswith("model.language_model.")]
    quantized = {name for name in decoder if is_quantized(name, (1, 1))}
    assert {manifest["tensors"][name]["dtype"] for name in quantized} == {"int8"}
    assert any(name.endswith("in_proj_qkv.weight") for name in quantized)
    kept = [name for name in manifest["tensors"] if name.endswith(("in_proj_a.weight", "in_proj_b.weight"))]
    assert kept and "int8" not in {manifest["tensors"][name]["dtype"] for name in kept}  # as the release stores them
    embedding = manifest["tensors"]["model.language_model.embed_tokens.weight"]
    assert embedding["dtype"] == "bfloat16" and manifest["tensors"]["lm_head.weight"]["dtype"] == "bfloat16"
    assert {manifest["tensors"][name]["dtype"] for name in manifest["tensors"] if name.startswith("joint_head") or
            manifest["tensors"][name]["file"] == "joint_head.safetensors"} == {"float32"}


def test_tensor_files_are_standard_safetensors(bundle_dir):
    from safetensors import safe_open

    for name in ("decoder.safetensors", "embeddings.safetensors", "lm_head.safetensors", "joint_head.safetensors"):
        mapped = MappedSafetensors(bundle_dir / name)
        with safe_open(str(bundle_dir / name), framework="pt") as library:
            assert set(library.keys()) == mapped.keys()
            for tensor in library.keys():
                assert torch.equal(library.get_tensor(tensor), mapped.get(tensor)), (name, tensor)


def test_writer_matches_the_library_reader_on_odd_shapes(tmp_path):
    from safetensors.torch import load_file

    tensors = {
        "scalar": torch.tensor(3.5),
        "int8": torch.randint(-127, 128, (3, 5), dtype=torch.int8),
        "bf16": torch.randn(7).bfloat16(),
        "fp32": torch.randn(2, 3, 1),
        "empty": torch.empty(0, 4),
    }
    plan = [safetensors_io.PlannedTensor(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    digest = safetensors_io.write_safetensors(tmp_path / "x.safetensors", plan, lambda p: tensors[p.name])
    assert digest == sha256_of(tmp_path / "x.safetensors")
    loaded = load_file(str(tmp_path / "x.safetensors"))
    mapped = MappedSafetensors(tmp_path / "x.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor) and torch.equal(mapped.get(name), tensor)


def test_bundle_answers_equal_the_release_quantized_at_load(bundle_dir, tiny_dir):
    requests = random_requests(3, 6)
    from_bundle = clef_flash.load(bundle_dir, device="cpu")  # the default: int8-w8a8 wherever a kernel is exact
    for precision in ("int8-weight-only", from_bundle.precision):
        from_release = clef_flash.load(tiny_dir, device="cpu", precision=precision)
        bundled = clef_flash.load(bundle_dir, device="cpu", precision=precision)
        assert bundled.is_random and bundled.plan == from_release.plan
        for request in requests:
            assert bundled.logits(request) == from_release.logits(request)


def test_embeddings_stay_in_the_memory_map(bundle_dir):
    release = clef_flash.load(bundle_dir, device="cpu").parts
    for tensor, file in ((release.decoder.embed_tokens.weight, "embeddings.safetensors"), (release.lm_head, "lm_head.safetensors")):
        assert tensor.dtype == torch.bfloat16
        # a view of the file's map, not a copy: its storage is the whole file
        assert tensor.untyped_storage().nbytes() == (bundle_dir / file).stat().st_size
    weight = release.decoder.layers[0].mlp.down_proj.weight
    assert weight.dtype == torch.int8
    assert weight.untyped_storage().nbytes() == (bundle_dir / "decoder.safetensors").stat().st_size


def test_truncated_file_is_refused_with_a_hint(bundle_dir, tmp_path):
    bundle = copy_of(bundle_dir, tmp_path)
    path = bundle / "decoder.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(BundleError, match="truncated or altered; convert the release again"):
        clef_flash.load(bundle, device="cpu")


def test_altered_file_is_caught_by_verify(bundle_dir, tmp_path):
    bundle = copy_of(bundle_dir, tmp_path)
    path = bundle / "decoder.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    clef_flash.load(bundle, device="cpu")  # sizes match: only the checksums can tell
    with pytest.raises(BundleError, match="does not match its sha256"):
        clef_flash.load(bundle, device="cpu", verify=True)


def test_missing_file_and_unknown_version_are_refused(bundle_dir, tmp_path):
    bundle = copy_of(bundle_dir, tmp_path)
    (bundle / "lm_head.safetensors").unlink()
    with pytest.raises(BundleError, match="lm_head.safetensors is missing from the bundle"):
        clef_flash.load(bundle, device="cpu")
    shutil.copyfile(bundle_dir / "lm_head.safetensors", bundle / "lm_head.safetensors")
    manifest = json.loads((bundle / MANIFEST).read_text())
    (bundle / MANIFEST).write_text(json.dumps({**manifest, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(BundleError, match=f"format version {FORMAT_VERSION + 1}.*convert the release again"):
        clef_flash.load(bundle, device="cpu")


def test_a_bundle_is_refused_at_16_bits(bundle_dir):
    with pytest.raises(ClefError, match="8-bit bundle: use precision int8"):
        clef_flash.load(bundle_dir, device="cpu", precision="bf16")


def test_interrupted_conversion_leaves_no_valid_looking_bundle(tiny_dir, tmp_path, monkeypatch):
    calls = {"count": 0}
    original = bundle_module.QuantizingSource.get

    def failing_get(self, name):
        calls["count"] += 1
        if calls["count"] == 40:
            raise KeyboardInterrupt  # as a Ctrl-C midway
        return original(self, name)

    monkeypatch.setattr(bundle_module.QuantizingSource, "get", failing_get)
    destination = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_dir, destination, progress=False)
    assert calls["count"] == 40
    assert list(tmp_path.iterdir()) == []  # neither the destination nor the staging directory


def test_killed_conversion_leaves_only_a_staging_directory_that_does_not_load(tiny_dir, tmp_path, monkeypatch):
    """SIGKILL cannot be cleaned up after: what is left has no manifest and is refused."""
    monkeypatch.setattr(bundle_module.shutil, "rmtree", lambda *args, **kwargs: None)  # as if killed: no cleanup
    monkeypatch.setattr(bundle_module, "write_json_durably", lambda path, value: (_ for _ in ()).throw(SystemExit))
    with pytest.raises(SystemExit):
        convert(tiny_dir, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    (staging,) = tmp_path.iterdir()
    assert staging.name.startswith(".out.converting-")
    with pytest.raises(ModelSourceError):
        clef_flash.load(staging, device="cpu")


def test_convert_command(tiny_dir, tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["convert", str(tiny_dir), str(out)]) == 0
    assert "checksums verified" in capsys.readouterr().out
    assert main(["convert", str(tiny_dir), str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {out} exists: remove it or pass --overwrite"
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "c")]) == 2
    assert "error:" in capsys.readouterr().err


def test_a_random_source_converts_to_the_bundle_of_its_written_release(bundle_dir, tmp_path, capsys):
    """`convert random:NAME` draws each tensor as it converts it (no release written: how a full-size random bundle
    fits a disk its release does not): every file byte for byte the written release's bundle, the manifest but for
    its source's path."""
    assert main(["convert", "random:tiny", str(tmp_path / "r")]) == 0
    drawn = tmp_path / "r"
    assert sorted(path.name for path in drawn.iterdir()) == sorted(path.name for path in bundle_dir.iterdir())
    for path in drawn.iterdir():
        if path.name != MANIFEST:
            assert path.read_bytes() == (bundle_dir / path.name).read_bytes(), path.name
    manifests = [json.loads((folder / MANIFEST).read_text()) for folder in (drawn, bundle_dir)]
    assert manifests[0]["source"].pop("path") == "random:tiny"
    manifests[1]["source"].pop("path")
    assert manifests[0] == manifests[1]
    assert main(["convert", "random:nope", str(tmp_path / "n")]) == 2
    assert "unknown random config 'nope'" in capsys.readouterr().err


AGREEMENT_REQUESTS = 12


@pytest.fixture(scope="module")
def fp32_results(tiny_dir, heads_dir):
    """fp32 probabilities per release (ours equal the reference's fp32 within 2e-5: test_model.py)."""
    cache = {}

    def get(name):
        if name not in cache:
            model = clef_flash.load({"tiny": tiny_dir, "9b-heads": heads_dir}[name], device="cpu", precision="fp32")
            records = [model.encode(request) for request in random_requests(5, AGREEMENT_REQUESTS)]
            cache[name] = (records, model.score(records))
        return cache[name]

    return get


@pytest.mark.parametrize(
    "name, precision",
    # W8A8 on 9b-heads is measured by benchmarks/agreement.py (its default configs): torch._int_mm is slow on CPUs without VNNI.
    [("tiny", "int8-weight-only"), pytest.param("9b-heads", "int8-weight-only", marks=pytest.mark.slow), ("tiny", "int8-w8a8")],
)
def test_int8_agrees_with_fp32(name, precision, tiny_dir, heads_dir, fp32_results):
    """Decisions differing and the median |dp| of each int8 mode against fp32."""
    from clef_flash.evaluate import agreement

    records, expected = fp32_results(name)
    int8 = clef_flash.load({"tiny": tiny_dir, "9b-heads": heads_dir}[name], device="cpu", precision=precision)
    report = agreement(expected, int8.score(records), near_tie=0.05)
    margins = [round(item["reference_margin"], 4) for item in report["differing"]]
    print(
        f"\n{name} {precision} vs fp32: {report['answers_differing']}/{report['questions']} decisions differ "
        f"(fp32 margins {margins}), median |dp| {report['median_abs_dp']:.2e}, max {report['max_abs_dp']:.2e}"
    )
    assert report["median_abs_dp"] < 5e-3
    assert report["near_ties"] == report["answers_differing"]  # only close calls (margin < 0.05) may flip


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_low_memory_mode_gives_the_same_answers_with_few_layers_resident(tiny_dir, bundle_dir, precision):
    source = bundle_dir if precision == "int8" else tiny_dir
    requests = random_requests(7, 3)
    whole = clef_flash.load(source, device="cpu", precision=precision)
    low = clef_flash.load(source, device="cpu", precision=precision, resident_layers=2)
    for request in requests:
        assert low.logits(request) == whole.logits(request)
    window = low.parts.decoder.layers[0].window
    assert window.most_resident == 2 < len(low.parts.decoder.layers)
    resident = [layer for layer in low.parts.decoder.layers if not layer.layer.input_layernorm.weight.is_meta]
    assert len(resident) == 2  # the others hold no weights between forwards


def test_answer_command_on_a_bundle_with_verify_and_resident_layers(bundle_dir, capsys):
    code = main(["answer", "--model", str(bundle_dir), "--verify", "--resident-layers", "1", "--json",
                 "--state", "Card charged twice", "--question", "refund=noul:Refund?"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert 0.0 <= json.loads(captured.out)["answers"]["refund"]["noul"] <= 1.0
    with pytest.raises(SystemExit):  # argparse refuses 0 with its usage line
        main(["answer", "--model", str(bundle_dir), "--resident-layers", "0", "--state", "x", "--question", "r=noul:R?"])


def test_unknown_precision_is_a_clear_error(tiny_dir):
    with pytest.raises(ClefError, match="unknown precision 'fp16': use one of fp32, bf16, fp64, int8, int8-weight-only, int8-w8a8"):
        clef_flash.load(tiny_dir, device="cpu", precision="fp16")
