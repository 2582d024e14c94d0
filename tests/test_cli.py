"""The command line on the tiny release: outputs, and errors as one clear line with a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from clef_flash.cli import build_parser, main
from clef_flash.request.spec import parse_question_spec

FLAGS = [
    "--state", "My card was charged twice, please refund.",
    "--question", "team=choice:Which team?:billing=Charges,engineering=Bugs,other",
    "--question", "urgent=noul:Is it urgent?",
    "--question", "urgency=score:How urgent: really?:Low,Normal,High",
]


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_question_specs_cover_all_three_types():
    assert parse_question_spec("urgent=noul:Is it urgent?") == ("urgent", {"type": "noul", "instructions": "Is it urgent?"})
    assert parse_question_spec("team=choice:Which team?:billing=Charges,engineering=Bugs,other") == (
        "team",
        {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "Charges", "engineering": "Bugs", "other": None}},
    )
    assert parse_question_spec("u=score:How: urgent?:Low,High") == (
        "u",
        {"type": "score", "instructions": "How: urgent?", "criteria": ["Low", "High"]},
    )



def test_env_defaults_are_read_when_the_parser_is_built(monkeypatch):
    for name, value in {"MODEL": "/models/clef", "DEVICE": "cpu", "PRECISION": "fp32", "API_KEY": "key"}.items():
        monkeypatch.setenv(f"CLEF_FLASH_{name}", value)
    args = build_parser().parse_args(["serve"])
    assert (args.model, args.device, args.precision, args.api_key) == ("/models/clef", "cpu", "fp32", "key")
    first = build_parser().parse_args(["answer"])
    first.question.append("urgent=noul:Is it urgent?")
    assert build_parser().parse_args(["answer"]).question == []  # the table's default=[] is not shared


def test_answer_json_from_flags(capsys, tiny_dir):
    code, out, err = run(capsys, "answer", "--model", str(tiny_dir), "--json", "--timings", *FLAGS)
    assert code == 0, err
    body = json.loads(out)
    assert list(body["answers"]) == ["team", "urgent", "urgency"]
    assert list(body["answers"]["team"]["probabilities"]) == ["billing", "engineering", "other"]
    assert abs(sum(body["answers"]["team"]["probabilities"].values()) - 1) < 2e-3
    assert set(body["timings"]) >= {"tokenize_ms", "decoder_ms", "head_ms", "total_ms"}


def test_answer_table_from_a_file(capsys, tiny_dir, tmp_path):
    request = {"model": "clef-flash", "state": {"ticket": "refund please"}, "questions": {"refund": {"type": "noul", "instructions": "Refund?"}}}
    path = tmp_path / "request.json"
    path.write_text(json.dumps(request))
    code, out, err = run(capsys, "answer", "--model", str(tiny_dir), "--table", "--timings", str(path))
    assert code == 0, err
    assert "random weights" in out
    assert "refund  (noul)" in out and "true" in out and "█" in out
    assert "decoder" in out and "ms" in out


def test_render_marks_spans_and_counts_tokens(capsys, tiny_dir):
    code, out, err = run(capsys, "render", "--model", str(tiny_dir), *FLAGS)
    assert code == 0, err
    assert "⟦Q team:Which team?⟧" in out
    assert '⟦O billing:{"description":"Charges","option_id":"billing"}⟧' in out
    assert "STATE:\nMy card was charged twice" in out
    assert "tokens: prefix 36, state" in err and "of 65536" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["answer", "--model", "/no/such/dir", *FLAGS], "no model at '/no/such/dir'"),
        (["answer", "--model", "Cloudflare/clef-flash", *FLAGS], "`hf download Cloudflare/clef-flash --local-dir DIR`"),
        (["answer", "--question", "team=choose:x:a,b", "--state", "s"], "bad --question 'team=choose:x:a,b'"),
        (["answer", "--question", "team=choice:Which?", "--state", "s"], "needs its options"),
        (["answer", "--state", "s"], "add at least one --question"),
        (["answer", "--question", "team=choice:Which?:a", "--state", "s"], "body.questions.team.criteria"),
        (["render", "--max-length", "50", *FLAGS], "over the limit of 50"),
    ],
)
def test_errors_are_one_clear_line(capsys, tiny_dir, argv, message):
    if "--model" not in argv:
        argv = [*argv, "--model", str(tiny_dir)]
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_offline_hub_id_is_one_short_line_naming_hf(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run(capsys, "answer", "--model", "Cloudflare/clef-flash", *FLAGS)
    print(err)
    assert code == 2 and len(err.strip().splitlines()) == 1 and len(err) < 200
    assert "hf download" in err and "huggingface-cli" not in err and "offline" in err


NOT_UTF8 = '{"state": "caf\xe9 charged twice", "questions": {"q": {"type": "noul"}}}'.encode("latin-1")


def test_input_that_is_not_utf8_is_one_line_naming_the_file_and_offset(capsys, tiny_dir, tmp_path, monkeypatch):
    import io

    offset = NOT_UTF8.index(b"\xe9")
    request = tmp_path / "request.json"
    request.write_bytes(NOT_UTF8)
    state = tmp_path / "state.txt"
    state.write_bytes(NOT_UTF8[11:])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(NOT_UTF8)))
    for argv, where, at in (
        ([str(request)], str(request), offset),
        (["--state-file", str(state), "--question", "q=noul:Urgent?"], str(state), offset - 11),
        (["-"], "stdin", offset),
    ):
        code, _, err = run(capsys, "answer", "--model", str(tiny_dir), *argv)
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert f"{where} is not UTF-8 text: byte 0xe9 at offset {at}" in err, err


def test_truncate_state_says_how_many_tokens_were_cut(capsys, tiny_dir):
    long_state = ["--state", "My card was charged twice, please refund. " * 40, *FLAGS[2:]]
    code, _, err = run(capsys, "answer", "--model", str(tiny_dir), "--max-length", "300", *long_state)
    assert code == 2 and "--truncate-state" in err  # refused, and told how to cut it
    code, out, err = run(capsys, "answer", "--model", str(tiny_dir), "--max-length", "300", "--json", "--truncate-state", *long_state)
    assert code == 0, err
    cut = int(err.split("cut ")[1].split(" tokens")[0])
    assert cut > 0 and "of 300 in all" in err
    # The state's tail is cut to exactly what the limit leaves (records.encode_record): the record is 300 tokens.
    assert json.loads(out)["usage"]["input_tokens"] == 300
    code, _, err = run(capsys, "render", "--model", str(tiny_dir), "--max-length", "300", "--truncate-state", *long_state)
    assert code == 0 and f"({cut} cut from its end)" in err


def test_tiny_command_writes_a_loadable_release(tmp_path):
    out = tmp_path / "tiny"
    result = subprocess.run([sys.executable, "-m", "clef_flash.cli", "tiny", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for name in ("config.json", "model.safetensors", "joint_head.safetensors", "joint_head_config.json", "tokenizer.json"):
        assert (out / name).is_file()
    assert json.loads((out / "config.json").read_text())["clef_flash_random"]["config"] == "tiny"


@pytest.mark.parametrize("command", ["tiny", "bench"])
def test_help_names_every_random_config(capsys, monkeypatch, command):
    from clef_flash.checkpoint.random_release import RANDOM_CONFIGS

    monkeypatch.setenv("COLUMNS", "400")  # no line breaks inside a config's name
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert [name for name in RANDOM_CONFIGS if name not in out] == []


def test_server_limits_that_do_not_combine_are_one_line_naming_the_flags(capsys):
    """A text body limit past half the parsing budget (the video limit rises with it): refused before any model loads,
    in the flags' names, never a traceback."""
    assert main(["serve", "--model", "tiny", "--max-body-bytes", "50000000"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: --max-parsing-bytes (71303168) must be at least twice --max-video-body-bytes (50000000)"), error
    assert "\n" not in error and "max_" not in error
