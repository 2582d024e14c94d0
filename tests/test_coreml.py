"""The Core ML export (clef_flash/coreml/) on Linux: twins, packages, host, refusals.

What runs here: the export twins (model/export.py) against our decoder and head; a tiny export written by
coremltools, read back through `MLModel(..., skip_model_load=True)` and its MIL program (functions, shapes,
dtypes, int8 weights and scales, weights stored once); the host with the traced torch twins standing in for
Core ML, against our fp32 engine; the refusals; benchmarks/coreml_mac.py end to end. What only a Mac can
run: Core ML's own predictions (README, "Core ML").
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

ct = pytest.importorskip("coremltools", reason='the Core ML extra is not installed (pip install -e ".[coreml]")')

import clef_flash  # noqa: E402
from clef_flash.checkpoint import build_model, open_checkpoint  # noqa: E402
from clef_flash.plan import Plan  # noqa: E402
from clef_flash.checkpoint.quant import quantize_per_channel  # noqa: E402
from clef_flash.checkpoint import coreml_layout as layout  # noqa: E402
from clef_flash.coreml.export import const_name, export_coreml, fp32_ops  # noqa: E402
from clef_flash.coreml.host import CoreMLHost  # noqa: E402
from clef_flash.coreml.modules import build_head, build_part, part_layers  # noqa: E402
from clef_flash.clef import Clef  # noqa: E402
from clef_flash.errors import ModelSourceError, RequestInvalid  # noqa: E402
from clef_flash.model.config import TextConfig  # noqa: E402
from clef_flash.model.export import FAMILIES, rotary_tables  # noqa: E402
from clef_flash.model.head_batch import build_head_batch  # noqa: E402
from clef_flash.model.ops.gated_delta_rule import l2norm, naive_recurrent_gated_delta_rule  # noqa: E402
from clef_flash.model.ops.static_delta_rule import static_chunk_gated_delta_rule, unit_lower_inverse  # noqa: E402
from clef_flash.model.precision import COREML_FP32_FAMILIES, FP16, FP32, FP64, PRECISIONS, WEIGHT_ONLY, is_quantized  # noqa: E402

BUCKETS = (192, 384)  # the tiny export: two functions, records of up to 384 tokens
LAYERS_PER_PART = 2  # tiny's 4 layers as 2 parts: [linear, linear], [linear, full] + the final norm
HEAD_QUESTIONS, HEAD_OPTIONS = 4, 24


def rel(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return ((actual.double() - reference.double()).abs().max() / reference.double().abs().max()).item()


def short_request(questions: int = 2, options: int = 3, state: str = "Charged twice, refund please.") -> dict:
    """A record of ~100-250 tokens (tiny's buckets)."""
    asked = {"urgent": {"type": "noul", "instructions": "Urgent?"}}
    if questions > 1:
        asked["team"] = {"type": "choice", "instructions": "Team?", "criteria": {f"t{i}": None for i in range(options)}}
    for index in range(2, questions):
        asked[f"q{index}"] = {"type": "score", "instructions": "How?", "criteria": ["low", "high"]}
    return {"model": "clef-flash", "state": state, "questions": asked}


@pytest.fixture(scope="module")
def tiny():
    checkpoint = open_checkpoint("tiny")
    return checkpoint, TextConfig.from_release_config(checkpoint.config)


@pytest.fixture(scope="module")
def exported(module_tmp) -> Path:
    out = module_tmp("coreml") / "tiny-coreml"
    export_coreml(
        "tiny", out, buckets=BUCKETS, layers_per_part=LAYERS_PER_PART, head_questions=HEAD_QUESTIONS, head_options=HEAD_OPTIONS
    )
    return out


@pytest.fixture(scope="module")
def model(exported) -> Clef:
    return clef_flash.load(exported, coreml_runner="torch")


# -- the twins ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 63, 64, 65, 130])
def test_static_delta_rule_equals_the_token_recurrence(T):
    gen = torch.Generator().manual_seed(T)
    q = l2norm(torch.randn(2, T, 3, 16, generator=gen, dtype=FP64)) * 16**-0.5
    k = l2norm(torch.randn(2, T, 3, 16, generator=gen, dtype=FP64))
    v = torch.randn(2, T, 6, 12, generator=gen, dtype=FP64)
    g = -torch.rand(2, T, 6, generator=gen, dtype=FP64) * (40.0 if T == 130 else 1.0)  # strong decay at 130
    beta = torch.rand(2, T, 6, generator=gen, dtype=FP64)
    reference, _ = naive_recurrent_gated_delta_rule(q, k, v, g, beta)
    error = rel(static_chunk_gated_delta_rule(q, k, v, g, beta), reference)
    print(f"T={T}: static chunks vs recurrence, float64: {error:.1e}")
    assert error <= 1e-12


def test_block_recursive_inverse():
    strict = torch.randn(5, 64, 64, dtype=FP64).tril(-1) * 0.3
    eye = torch.eye(64, dtype=FP64)
    assert (unit_lower_inverse(strict) @ (eye + strict) - eye).abs().max() <= 1e-12
    with pytest.raises(ValueError, match="power-of-two"):
        unit_lower_inverse(torch.zeros(3, 3))


def test_parts_chained_over_padded_records_equal_the_decoder(tiny):
    checkpoint, config = tiny
    decoder = build_model(checkpoint, Plan(PRECISIONS["fp32"], torch.device("cpu"))).decoder
    plan = part_layers(config, LAYERS_PER_PART)
    parts = [build_part(checkpoint, config, layers, final_norm=index == len(plan) - 1) for index, layers in enumerate(plan)]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for length, bucket in ((1, 64), (100, 128), (200, 256)):
            ids = torch.randint(0, config.vocab_size, (1, length), generator=gen)
            reference = decoder(ids)  # [1, n, D]
            results = {}
            for dtype in (FP32, FP16):
                hidden = torch.zeros(1, bucket, config.hidden_size, dtype=dtype)
                hidden[:, :length] = decoder.embed_tokens(ids).to(dtype)
                cos, sin = rotary_tables(config, bucket, dtype)
                for part in parts:
                    hidden = part.to(dtype)(hidden, cos, sin)
                results[dtype] = rel(hidden[:, :length], reference)
            print(f"n={length} padded to {bucket}: fp32 {results[FP32]:.1e}, fp16 (Core ML's compute) {results[FP16]:.1e}")
            assert results[FP32] <= 1e-4
            assert results[FP16] <= 0.25  # reported; the fp16 error of tiny random layers (README)
            for part in parts:
                part.to(FP32)


@pytest.mark.slow  # a Core ML export
def test_export_head_with_host_matrices_equals_the_head(tiny, exported):
    checkpoint, config = tiny
    parts = build_model(checkpoint, Plan(PRECISIONS["fp32"], torch.device("cpu")))
    export_head = build_head(checkpoint)
    host = CoreMLHost(exported, runner=None)  # only its input builders
    encoder = clef_flash.load("tiny", precision="fp32")
    gen = torch.Generator().manual_seed(1)
    for questions, options in ((1, 2), (2, 7), (4, 6)):  # up to the head's shape: 4 questions (of 4)
        record = encoder.encode(short_request(questions, options))
        n = record.token_count
        bucket = host.bucket_for(n)
        hidden = torch.randn(1, n, config.hidden_size, generator=gen)
        batch = build_head_batch([record])
        table = host.output_embeddings.to(FP32)
        with torch.no_grad():
            reference = parts.head(hidden, torch.tensor([n]), batch, table)  # [No]
            states = torch.zeros(bucket, config.hidden_size)
            states[:n] = hidden[0]
            inputs = host.head_inputs(record, bucket, states)
            logits = export_head(*(inputs[name] for name in layout.HEAD_INPUTS))
        error = rel(logits[: batch.num_options], reference)
        print(f"{questions} questions, {batch.num_options} options, L{bucket}: export head vs head, fp32: {error:.1e}")
        assert error <= 1e-5
        assert (logits[batch.num_options :] < -5e3).all()  # padding options carry the mask


FAMILY_RUNS = {"tiny": (200, 256), "random:9b-heads": (100, 128)}  # tokens, bucket: small enough for fp16 on CPUs


@pytest.mark.parametrize("source", [pytest.param(name, marks=[pytest.mark.slow] if name != "tiny" else []) for name in FAMILY_RUNS])
def test_fp16_twin_error_per_part_and_op_family(source):
    """The twins with fp16 weights, computing in fp16 everywhere, in fp32 everywhere, each op family alone in fp16
    (the rest fp32) and alone kept in fp32 (the rest fp16), and as shipped (COREML_FP32_FAMILIES in fp32): the error
    after each part against our fp32 decoder's hidden states at that layer. The families that break the bar (2x
    our bf16 decoder's error) alone in fp16 are exactly the ones the packages keep in fp32, and as shipped the twins
    meet the bar."""
    checkpoint = open_checkpoint(source)
    config = TextConfig.from_release_config(checkpoint.config)
    length, bucket = FAMILY_RUNS[source]
    cpu = torch.device("cpu")
    decoder = build_model(checkpoint, Plan(PRECISIONS["fp32"], cpu)).decoder
    bf16 = build_model(checkpoint, Plan(PRECISIONS["bf16"], cpu)).decoder
    plan = part_layers(config, LAYERS_PER_PART)
    parts = [build_part(checkpoint, config, layers, final_norm=index == len(plan) - 1) for index, layers in enumerate(plan)]
    ids = torch.randint(0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = decoder(ids)
        bf16_error = rel(bf16(ids).float(), reference)
        boundaries, hidden = [], torch.zeros(1, bucket, config.hidden_size)  # the fp32 twins' part outputs
        hidden[:, :length] = decoder.embed_tokens(ids)
        cos, sin = rotary_tables(config, bucket, FP32)
        for part in parts:
            hidden = part(hidden, cos, sin)
            boundaries.append(hidden[:, :length])
        assert rel(boundaries[-1], reference) <= 1e-4
        for part in parts:
            part.to(FP16)  # Core ML's weights: int8 x fp16 scales and fp16 tensors, here fp16

        def errors(dtype, families: dict) -> list[float]:
            hidden = torch.zeros(1, bucket, config.hidden_size, dtype=dtype)
            hidden[:, :length] = decoder.embed_tokens(ids).to(dtype)
            cos, sin = rotary_tables(config, bucket, dtype)
            out = []
            for part, boundary in zip(parts, boundaries):
                hidden = part.compute_families({family: families.get(family) for family in FAMILIES})(hidden, cos, sin)
                out.append(rel(hidden[:, :length], boundary))
            return out

        runs = {"fp32 compute": errors(FP32, {}), "fp16 compute (before)": errors(FP16, {})}
        for family in FAMILIES:
            runs[f"{family} alone in fp16"] = errors(FP32, {family: FP16})
            runs[f"{family} alone kept in fp32"] = errors(FP16, {family: FP32})
        shipped = f"fp16, {', '.join(COREML_FP32_FAMILIES)} in fp32 (after)"
        runs[shipped] = errors(FP16, {family: FP32 for family in COREML_FP32_FAMILIES})
    bar = 2 * bf16_error
    print(f"\n{source}, {length} tokens in L{bucket}: max |d| / max |ref| after each part vs our fp32 decoder; "
          f"our bf16 decoder {bf16_error:.2e}, the bar {bar:.2e}")  # fmt: skip
    print("| run | " + " | ".join(f"part{index:02d}" for index in range(len(parts))) + " |")
    for name, values in runs.items():
        print(f"| {name} | " + " | ".join(f"{value:.2e}" for value in values) + " |")
    named = {family for family in FAMILIES if runs[f"{family} alone in fp16"][-1] > bar}
    assert named == set(COREML_FP32_FAMILIES), f"the measurement names {sorted(named)}"
    assert runs["fp16 compute (before)"][-1] > bar
    assert runs[shipped][-1] <= bar


# -- the packages ---------------------------------------------------------------------------------------


def read_back(package: Path, function: str):
    """The MIL program of one function of a saved package (weights read from its weight file)."""
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load

    spec = ct.models.MLModel(str(package), skip_model_load=True).get_spec()
    weights = package / "Data" / "com.apple.CoreML" / "weights"
    return spec, milproto_load(spec, spec.specificationVersion, str(weights)).functions[function]


@pytest.mark.slow  # a Core ML export
def test_packages_have_the_ports_layout(exported, tiny):
    _, config = tiny
    files = {path.name for path in exported.iterdir()}
    assert files == {"part00.mlpackage", "part01.mlpackage", "Head.mlpackage", "embeddings.f16", "output_embeddings.f16",
                     "tokenizer.json", "config.json", "manifest.json"}  # fmt: skip
    host_config = json.loads((exported / "config.json").read_text())
    assert host_config["buckets"] == list(BUCKETS) and host_config["head"]["questions"] == HEAD_QUESTIONS
    assert [part["layers"] for part in host_config["parts"]] == [[0, 1], [2, 3]]
    layout.read_export(exported, verify=True)  # every file's size and sha256
    assert (exported / "embeddings.f16").stat().st_size == config.vocab_size * config.hidden_size * 2

    float16 = ct.proto.FeatureTypes_pb2.ArrayFeatureType.FLOAT16
    float32 = ct.proto.FeatureTypes_pb2.ArrayFeatureType.FLOAT32
    for package, inputs, output, dtype in (
        ("part00.mlpackage", layout.PART_INPUTS, layout.PART_OUTPUT, float16),
        ("Head.mlpackage", layout.HEAD_INPUTS, layout.HEAD_OUTPUT, float32),
    ):
        spec = ct.models.MLModel(str(exported / package), skip_model_load=True).get_spec()
        functions = {function.name: function for function in spec.description.functions}
        assert list(functions) == [layout.function_name(bucket) for bucket in BUCKETS]
        assert spec.description.defaultFunctionName == "L192"
        for bucket in BUCKETS:
            function = functions[layout.function_name(bucket)]
            if package == "Head.mlpackage":
                shapes = layout.head_shapes(bucket, config.hidden_size, HEAD_QUESTIONS, HEAD_OPTIONS)
            else:
                shapes = layout.part_shapes(bucket, config.hidden_size, config.rotary_dim)
            assert [feature.name for feature in function.input] == list(inputs)
            for feature in function.input:
                assert tuple(feature.type.multiArrayType.shape) == shapes[feature.name]
                assert feature.type.multiArrayType.dataType == dtype
            (out,) = function.output
            assert out.name == output and out.type.multiArrayType.dataType == dtype


@pytest.mark.slow  # a Core ML export
def test_decoder_weights_are_int8_per_channel_as_our_scheme_and_stored_once(exported, tiny):
    checkpoint, _ = tiny
    package = exported / "part01.mlpackage"
    part = build_part(checkpoint, TextConfig.from_release_config(checkpoint.config), [2, 3], final_norm=True)
    state = part.state_dict()
    quantized = {name for name, tensor in state.items() if is_quantized(name, tuple(tensor.shape))}
    assert "layers.2.linear_attn.in_proj_qkv.weight" in quantized and "layers.2.linear_attn.in_proj_a.weight" not in quantized
    for bucket in BUCKETS:
        _, function = read_back(package, layout.function_name(bucket))
        constexprs = {op.name: op for op in function.operations if op.op_type == "constexpr_blockwise_shift_scale"}
        assert {name.removesuffix("_quantized") for name in constexprs} == {const_name(name) for name in quantized}
        worst = 0.0
        for name in quantized:
            op = constexprs[const_name(name) + "_quantized"]
            data, scale = op.data.val, op.scale.val  # int8 [O, I], fp16 [O, 1]
            ours_q, ours_scale = quantize_per_channel(state[name])
            assert str(data.dtype) == "int8" and scale.shape == (ours_q.shape[0], 1) and op.offset is None
            assert (torch.from_numpy(data.astype("int32")) - ours_q.int()).abs().max() <= 1  # rounding ties only
            worst = max(worst, rel(torch.from_numpy(scale[:, 0].astype("float32")), ours_scale))
        print(f"L{bucket}: {len(quantized)} int8 weights; scales vs ours (fp16 rounding): {worst:.1e}")
        assert worst <= 1e-3
        # everything else (norms, conv, A_log, dt_bias, in_proj_a / in_proj_b) stays fp16, but for what only the
        # fp32 ops read (the gated norm's weight): Core ML keeps an fp32 op's constants fp32
        kept = set(fp32_ops(function))
        dense = [op for op in function.operations if op.op_type == "const" and getattr(op.outputs[0].val, "size", 0) >= 16]
        floats = [op for op in dense if op.outputs[0].val.dtype.kind == "f"]
        wide = [op for op in floats if str(op.outputs[0].val.dtype) != "float16"]
        assert dense and len(wide) < len(floats)
        assert all(child.name in kept for op in wide for child in op.outputs[0].child_ops), [op.name for op in wide]
    # weights once: the weight file holds one function's constants (int8 weights, fp16 tensors, the chunk
    # masks), not one copy per function
    one_function = sum(
        op.outputs[0].val.nbytes
        for op in function.operations
        if op.op_type == "const" and getattr(op.outputs[0].val, "nbytes", 0) >= 512
    )
    int8_bytes = sum(state[name].numel() for name in quantized)
    weight_file = (package / "Data" / "com.apple.CoreML" / "weights" / "weight.bin").stat().st_size
    print(f"part01: weight.bin {weight_file} B; one function's constants {one_function} B, of which int8 weights {int8_bytes} B")
    assert int8_bytes <= one_function <= weight_file <= one_function + 16_384  # + 64-byte alignment per blob


@pytest.mark.slow  # a Core ML export read back
def test_the_manifest_lists_the_ops_the_packages_compute_in_fp32(exported):
    """Read back from each part's program: the ops with fp32 outputs (neither const nor cast) are exactly the
    manifest's list, per function; the head is all fp32 and listed as such."""
    manifest = json.loads((exported / "manifest.json").read_text())
    assert manifest["compute"]["fp32_families"] == list(COREML_FP32_FAMILIES)
    listed = manifest["compute"]["fp32_ops"]
    assert sorted(listed) == ["part00.mlpackage", "part01.mlpackage"]
    for package, functions in listed.items():
        assert sorted(functions) == sorted(layout.function_name(bucket) for bucket in BUCKETS)
        for function_name, names in functions.items():
            _, function = read_back(exported / package, function_name)
            assert names and fp32_ops(function) == names
            computing = [op for op in function.operations if op.op_type not in ("const", "cast")]
            print(f"{package} {function_name}: {len(names)} of {len(computing)} ops in fp32")
            assert len(names) < len(computing) / 5


@pytest.mark.slow  # fp16 on the CPU, 18 records twice
def test_the_mixed_fp16_twins_decide_as_fp32_on_54_questions(exported):
    """The export's fp16 stand-in (its fp32 families in fp32, as the packages) against our fp32 engine: the same
    decisions on every question; all-fp16 printed beside it."""
    from clef_flash.coreml.runners import TorchRunner
    from clef_flash.evaluate import agreement

    reference = clef_flash.load("tiny", precision="fp32")
    states = ["Charged twice, refund please.", "The app crashes on login since the update.", "Where is my parcel?"]
    requests = [short_request(3, 2 + index % 5, state=states[index % 3] * (1 + index % 4)) for index in range(18)]
    truth = reference.score([reference.encode(request) for request in requests])
    export = layout.read_export(exported)
    results = {}
    for name, families in (("fp16, all", ()), ("fp16, gated_norm in fp32", None)):
        model = clef_flash.load(exported, coreml_runner=TorchRunner("tiny", export, part_dtype=FP16, fp32_families=families))
        results[name] = agreement(truth, model.score([model.encode(request) for request in requests]))
        report = results[name]
        print(f"{name}: {report['answers_differing']} of {report['questions']} decisions differ from fp32, median |dp| "
              f"{report['median_abs_dp']:.1e}, max {report['max_abs_dp']:.1e}")  # fmt: skip
    shipped = results["fp16, gated_norm in fp32"]
    assert shipped["questions"] >= 50 and shipped["answers_differing"] == 0
    assert shipped["max_abs_dp"] < results["fp16, all"]["max_abs_dp"]


@pytest.mark.slow  # three small exports and two cut short
def test_an_interrupted_export_resumes_writing_nothing_twice(tmp_path, monkeypatch):
    """Interrupted in the head's conversion, after both parts: run again, it keeps the parts (their hashes checked),
    writes the head and the tables once, and ends with the same files and hashes as one uninterrupted run.
    The uninterrupted run leaves no temporary package behind: coremltools removes the packages it converts into only
    when the process exits (~2.6 GB a bucket for the 9B, which filled the disk of a whole export); the export removes
    each as soon as it is saved."""
    import tempfile

    import clef_flash.coreml.export as export_module

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    options = dict(buckets=(64,), layers_per_part=LAYERS_PER_PART, head_questions=2, head_options=4, tables=True)
    export_coreml("tiny", tmp_path / "one", **options)
    assert sorted(path.name for path in scratch.iterdir() if path.suffix == ".mlpackage") == []
    writes: dict[str, int] = {}
    merge, write_table = export_module.merge_functions, export_module._write_table

    def counted_merge(ct, packages, destination):
        writes[destination.name] = writes.get(destination.name, 0) + 1
        merge(ct, packages, destination)

    def counted_table(table, path):
        writes[path.name] = writes.get(path.name, 0) + 1
        write_table(table, path)

    monkeypatch.setattr(export_module, "merge_functions", counted_merge)
    monkeypatch.setattr(export_module, "_write_table", counted_table)

    class Interrupted(Exception):
        pass

    def interrupt_at(start: str):
        def log(message: str) -> None:
            if start in message:
                raise Interrupted

        return log

    interrupt = interrupt_at("Head L64 converted")

    with pytest.raises(Interrupted):
        export_coreml("tiny", tmp_path / "two", log=interrupt, **options)
    staging = tmp_path / ".two.exporting"
    assert not (tmp_path / "two").exists()
    assert sorted(json.loads((staging / "progress.json").read_text())["done"]) == ["part00.mlpackage", "part01.mlpackage"]
    report = export_coreml("tiny", tmp_path / "two", **options)
    assert report["resumed"] == ["part00.mlpackage", "part01.mlpackage"] and not staging.exists()
    assert writes == dict.fromkeys(["part00.mlpackage", "part01.mlpackage", "Head.mlpackage", "embeddings.f16", "output_embeddings.f16"], 1)
    one, two = (json.loads((tmp_path / name / "manifest.json").read_text()) for name in ("one", "two"))
    assert one["files"] == two["files"] and one["compute"] == two["compute"]
    layout.read_export(tmp_path / "two", verify=True)
    # other settings start over rather than mix two exports (each run stopped as soon as it has shown it)
    with pytest.raises(Interrupted):
        export_coreml("tiny", tmp_path / "four", log=interrupt_at("part00 L64 converted"), **options)
    with pytest.raises(Interrupted):
        export_coreml("tiny", tmp_path / "four", log=interrupt_at("other settings, started over"), **{**options, "head_options": 5})




@pytest.mark.slow  # a conversion and a Core ML export (12.7 s on Zen 4)
def test_a_bundle_exports_its_weights_in_their_plain_form(tmp_path, tiny):
    """A bundle's projections are smoothed and rotated int8 (checkpoint/quant.py); the export undoes both, and Core
    ML's per-channel 8-bit weights are the bundle's weights in their plain form, rounded once more."""
    from clef_flash.checkpoint.rotation import unrotate
    from clef_flash.checkpoint.quant import dequantize
    from clef_flash.conversion import convert

    bundle = convert("tiny", tmp_path / "bundle", progress=False)
    out = export_coreml(bundle, tmp_path / "export", buckets=(64,), layers_per_part=LAYERS_PER_PART, only_parts=[0], head_questions=2, head_options=4)
    assert out["files"]["part00.mlpackage"] > 0
    manifest = json.loads((tmp_path / "export" / "manifest.json").read_text())
    assert manifest["complete"] is False and manifest["weights"]["carried_from"].startswith("the bundle")
    stored = open_checkpoint(bundle).tensors
    _, function = read_back(tmp_path / "export" / "part00.mlpackage", "L64")
    checked, worst = 0, 0.0
    for op in function.operations:
        if op.op_type == "constexpr_blockwise_shift_scale":
            dotted = ("model.language_model." + op.name.removesuffix("_to_fp16_quantized")).replace("_", ".")
            name = next(key for key in stored.keys() if key.replace("_", ".") == dotted)
            plain = unrotate(dequantize(stored.get(name), stored.get(name + "_scale"))) / stored.get(name.removesuffix("weight") + "input_smoothing")
            exported = torch.from_numpy(op.data.val.astype("float32")) * torch.from_numpy(op.scale.val.astype("float32"))
            worst = max(worst, rel(exported, plain))
            checked += 1
    print(f"Core ML's 8-bit weights vs the bundle's in plain form: worst {worst:.1e} ({checked} projections)")
    assert checked == 2 * 6 and worst <= 1e-2  # per layer: in_proj_qkv, in_proj_z, out_proj, gate, up, down


def test_a_bundle_linear_exports_as_its_plain_weight():
    from clef_flash.checkpoint.quant import WeightOnlyLinear, quantize_weight, smoothing
    from clef_flash.coreml.modules import _dense_linears
    from clef_flash.model.export import ExportLinear

    gen = torch.Generator().manual_seed(2)
    holder = torch.nn.Module()
    holder.proj = WeightOnlyLinear(32, 16)
    weight, s = torch.randn(16, 32, generator=gen), smoothing(torch.rand(32, generator=gen) * 3, 32, offset=True)
    q, scale = quantize_weight(weight, s)
    holder.proj.load_state_dict({"weight": q, "weight_scale": scale, "input_smoothing": s})
    x = torch.randn(5, 32, generator=gen) * s
    expected = holder.proj(x)
    _dense_linears(holder)
    assert isinstance(holder.proj, ExportLinear)
    assert rel(holder.proj(x), expected) <= 1e-5


# -- the host, with the torch twins standing in for Core ML ------------------------------------------------


@pytest.mark.slow  # a Core ML export
def test_the_host_answers_as_our_fp32_engine(model):
    reference = clef_flash.load("tiny", precision="fp32")
    for request in (short_request(1), short_request(2, 5), short_request(3, 2, state="x " * 60)):
        record = model.encode(request)
        ours, theirs = model.logits(request), reference.logits(request)
        worst = max(abs(ours[q][o] - theirs[q][o]) / max(abs(v) for qs in theirs.values() for v in qs.values())
                    for q in theirs for o in theirs[q])  # fmt: skip
        print(f"{record.token_count} tokens (bucket L{model.host.bucket_for(record.token_count)}): logits vs fp32 engine {worst:.1e}")
        assert worst <= 1e-4
    body = model.answer(short_request(2))
    assert set(body["answers"]) == {"urgent", "team"} and body["usage"]["input_tokens"] > 0
    assert model.precision == "coreml-int8-fp16" and model.is_random


@pytest.mark.slow  # a Core ML export
def test_refusals_name_the_counts(model):
    with pytest.raises(RequestInvalid, match=r"needs \d+ tokens, over the largest Core ML bucket of this export \(384"):
        model.answer(short_request(1, state="word " * 400))
    with pytest.raises(RequestInvalid, match="5 questions, the Core ML head holds 4"):
        model.answer(short_request(5, 2))
    with pytest.raises(RequestInvalid, match="26 options in all, the Core ML head holds 24"):
        model.answer(short_request(2, 24))


@pytest.mark.skipif(sys.platform == "darwin", reason="on macOS the export loads through Core ML")
@pytest.mark.slow  # a Core ML export
def test_loading_an_export_off_macos_says_core_ml_needs_macos(exported):
    with pytest.raises(ModelSourceError, match="Core ML runs only on macOS"):
        clef_flash.load(exported)


@pytest.mark.slow  # a Core ML export
def test_the_mac_benchmark_runs_end_to_end_with_the_stand_in(exported, model, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import coreml_mac

    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(short_request(questions)) for questions in (1, 2, 3)))
    report = coreml_mac.main(
        [str(exported), "--source", "tiny", "--stand-in", "--requests-file", str(requests), "--rounds", "1",
         "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md")],
        runner=model.host.runner,  # the same stand-in, already traced
    )  # fmt: skip
    assert report["quality_vs_fp32"]["answers_differing"] == 0 and report["quality_vs_fp32"]["questions"] == 6
    assert report["speed"]["one_record_ms"] > 0 and json.loads((tmp_path / "r.json").read_text())["parts"] == 2
    assert list(report["speed"]["per_bucket"]) == [str(bucket) for bucket in BUCKETS]
    assert all(row["decoder_ms"] > 0 for row in report["speed"]["per_bucket"].values())
    table = (tmp_path / "r.md").read_text()
    assert "| L384 |" in table and "| 3 requests | 6 | 0 |" in table and report["machine"]["chip"] in table


# -- an export through the one engine: served, batched, evaluated like a bundle (issue 24) ------------------


@pytest.mark.slow  # a Core ML export
def test_an_export_opens_as_a_checkpoint_and_plans_as_exported(exported, model):
    checkpoint = open_checkpoint(exported)
    assert checkpoint.kind == "coreml" and checkpoint.tensors is None and checkpoint.is_random
    described = model.describe()
    assert described["plan"]["backend"] == "coreml" and "torch twins" in described["plan"]["reason"]
    assert described["state_reuse"].startswith("unsupported: the Core ML parts run a record whole")
    with pytest.raises(clef_flash.ClefError, match="runs as exported"):
        clef_flash.load(exported, coreml_runner="torch", precision="fp32")
    with pytest.raises(clef_flash.ClefError, match="applies to exports only"):
        clef_flash.load("tiny", coreml_runner="torch")


@pytest.mark.slow  # a Core ML export
def test_an_export_answers_as_the_fp32_engine_through_answer_many(model):
    """Several records in one call (the engine groups them; the backend runs each whole): the same decisions
    and probabilities as our fp32 torch path, within the fp32 twins' error."""
    reference = clef_flash.load("tiny", precision="fp32")
    requests = [short_request(1), short_request(2, 5), short_request(3, 2, state="x " * 60), short_request(2)]
    ours, theirs = model.answer_many(requests, decimals=None), reference.answer_many(requests, decimals=None)
    worst = 0.0
    for mine, truth in zip(ours, theirs):
        for question, answer in truth["answers"].items():
            if "choice" in answer:
                assert mine["answers"][question]["choice"] == answer["choice"]
            for key, value in answer.items():
                if isinstance(value, float):
                    worst = max(worst, abs(mine["answers"][question][key] - value))
    print(f"export (torch twins) vs fp32 engine over {len(requests)} records: max |dp| {worst:.1e}")
    assert worst <= 1e-4
    assert model.last_timings.records == 4 and model.state_cache.stats.hits == 0


@pytest.mark.slow  # a Core ML export
def test_serve_batch_and_eval_run_over_an_export(exported, model, tmp_path, capsys):
    from fastapi.testclient import TestClient

    from clef_flash.cli import main
    from clef_flash.server import create_app

    with TestClient(create_app(model)) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, client.get("/health").json()
            time.sleep(0.05)
        health = client.get("/health").json()
        assert health["plan"]["backend"] == "coreml" and health["precision"] == "coreml-int8-fp16"
        assert health["state_reuse"].startswith("unsupported") and health["buckets"] == list(BUCKETS)
        response = client.post("/v1/systemone", json=short_request(2))
        assert response.status_code == 200, response.text
        assert response.json()["answers"] == model.answer(short_request(2))["answers"]

    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(short_request(questions)) for questions in (1, 2, 3)) + "\n")
    output = tmp_path / "out.jsonl"
    assert main(["batch", str(requests), str(output), "--model", str(exported), "--coreml-runner", "torch"]) == 0
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(lines) == 3 and all("answers" in line for line in lines)
    assert json.loads(output.with_name("out.jsonl.progress.json").read_text())["model"]["precision"] == "coreml-int8-fp16"
    out = tmp_path / "agreement"
    code = main(["eval", "agreement", str(requests), "--model", str(exported), "--coreml-runner", "torch",
                 "--against-model", "tiny", "--against-precision", "fp32", "--out", str(out)])  # fmt: skip
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["answers_differing"] == 0 and report["questions"] == 6
