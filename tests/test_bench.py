"""`clef-flash bench`, generated requests of a token length, and random models built without files."""

from __future__ import annotations

import json

import pytest
import torch

from clef_flash.bench import bench
from clef_flash.cli import main
from clef_flash.checkpoint.random_release import RandomTensors, tiny_release
from clef_flash.request.samples import request_of_tokens
from clef_flash.checkpoint.safetensors_io import SafetensorsFiles
from clef_flash.checkpoint.sources import release_files

FIELDS = {
    "model", "random_weights", "precision", "device", "batch_size", "records", "forwards", "tokens_per_record",
    "latency_ms", "records_per_s", "tokens_per_s", "peak_rss_mb",
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tiny_dir):
    from clef_flash import load

    return load(tiny_dir, device="cpu", precision="fp32")


def test_random_tensors_are_the_files_tensors(tiny_dir):
    for files, drawn in (
        (SafetensorsFiles(release_files(tiny_dir)), RandomTensors.of_model("tiny", seed=0)),
        (SafetensorsFiles([tiny_dir / "joint_head.safetensors"]), RandomTensors.of_head("tiny", seed=0)),
    ):
        assert drawn.keys() == files.keys()
        for name in sorted(files.keys()):
            assert drawn.shape(name) == files.shape(name)
            expected, actual = files.get(name), drawn.get(name)
            assert actual.dtype == expected.dtype and torch.equal(actual, expected), name


def test_random_model_answers_as_the_written_release(model):
    from clef_flash import load

    request = {
        "state": "My card was charged twice.",
        "questions": {
            "team": {"type": "choice", "criteria": {"billing": None, "bugs": "Bugs", "other": None}},
            "urgent": {"type": "noul"},
            "level": {"type": "score", "criteria": ["Low", "Normal", "High"]},
        },
    }
    built = load("random:tiny", device="cpu", precision="fp32")
    assert built.is_random and built.source == "random:tiny" and built.precision == "fp32"
    loaded = load(tiny_release(), device="cpu", precision="fp32")
    # Equal tensors; the files' head tensors are memory-mapped at unaligned offsets, which moves
    # fp32 matmuls by a rounding step, so logits agree to float rounding rather than bit for bit.
    for question_id, logits in built.logits(request).items():
        expected = loaded.logits(request)[question_id]
        worst = max(abs(value - expected[option]) for option, value in logits.items())
        print(f"{question_id}: max |d logit| {worst:.1e}")
        assert worst < 1e-5
    answer, expected = built.answer(request), loaded.answer(request)
    assert answer["answers"]["team"]["choice"] == expected["answers"]["team"]["choice"]
    assert answer["answers"]["urgent"]["noul"] == pytest.approx(expected["answers"]["urgent"]["noul"], abs=1e-4)


@pytest.mark.parametrize("tokens", [400, 512, 1500])
def test_generated_requests_fill_the_token_length(model, tokens):
    def count(request):
        return model.encode(request).token_count

    request = request_of_tokens(count, tokens, seed=3)
    assert tokens - 8 <= count(request) <= tokens  # within a word of the target
    assert request == request_of_tokens(count, tokens, seed=3)
    words = request["state"].split()
    assert count({**request, "state": " ".join([*words, words[-1]])}) > tokens  # the most words that fit


def test_bench_measures_batches(model):
    requests = [request_of_tokens(lambda r: model.encode(r).token_count, 400, seed=seed) for seed in range(5)]
    result = bench(model, requests, batch_size=2)
    assert set(result) == FIELDS
    assert (result["records"], result["batch_size"], result["forwards"]) == (5, 2, 3)  # one forward per batch
    assert model.batch_tokens == 8192  # restored
    latency = result["latency_ms"]
    assert list(latency) == ["p50", "p90", "p99"] and 0 < latency["p50"] <= latency["p90"] <= latency["p99"]
    assert result["tokens_per_s"] == pytest.approx(result["records_per_s"] * result["tokens_per_record"])
    assert result["peak_rss_mb"] > 100


def test_bench_command_on_a_release_and_on_a_random_model(capsys, tiny_dir, tmp_path):
    code = main(["bench", "--model", str(tiny_dir), "--precision", "fp32", "--records", "3", "--tokens", "400", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert set(result) == FIELDS and result["model"] == str(tiny_dir) and result["records"] == 3
    assert 390 <= result["tokens_per_record"] <= 400

    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"state": "hi", "questions": {"u": {"type": "noul"}}}) + "\n")
    code = main(["bench", "--random", "tiny", "--precision", "fp32", "--requests", str(requests), "--batch-size", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("random:tiny (random weights), fp32 on cpu, batch size 2: 1 records")
    assert "latency per record  p50" in out and "tokens/s" in out and "peak RSS" in out


def test_bench_compares_batch_sizes_in_a_readable_plot(capsys, tmp_path):
    plot = tmp_path / "bench.png"
    code = main(["bench", "--random", "tiny", "--precision", "fp32", "--records", "4", "--tokens", "320", "--batch-size", "1,2", "--json", "--plot", str(plot)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert [json.loads(line)["batch_size"] for line in out.splitlines()] == [1, 2]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from clef_flash.plots import bench_figure

    figure = bench_figure([json.loads(line) for line in out.splitlines()])
    latency, throughput = figure.get_axes()
    assert [text.get_text() for text in latency.get_legend().get_texts()] == ["p50", "p90", "p99"]
    assert "latency" in latency.get_ylabel() and "records per second" in throughput.get_ylabel()
    assert latency.get_title() and throughput.get_title() and "batch size" in latency.get_xlabel()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--random", "huge"], "unknown random config 'huge'"),
        (["bench", "--requests", "/no/such.jsonl"], "no input file at /no/such.jsonl"),
        (["bench", "--model", "/no/such/dir"], "no model at '/no/such/dir'"),
    ],
)
def test_errors_are_one_clear_line(capsys, argv, message):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
