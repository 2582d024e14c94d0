"""Prompt processing beside llama.cpp, the CPU peer: the same random model, machine and run.

    python benchmarks/peer_llamacpp.py [--config 9b-part] [--rounds 3] [--precisions default,bf16,bundle:default]
                                       [--json out.json] [--force]
    python benchmarks/peer_llamacpp.py --setup-only      # build, write and convert (idempotent), time nothing

Setup, cached under benchmarks/.peer/ (gitignored) and skipped when already done: llama.cpp as vendored by
the llama-cpp-python 0.3.36 source distribution (it knows the `qwen35` architecture), built with CMake
(Release, GGML_NATIVE less the AMX kernels, which crash on this model; CPU only; llama-bench and
llama-quantize); a random release (`clef-flash tiny DIR --config CONFIG`; 9b-part: 4 layers of full 9B
sizes, 5.8 GB of bf16; `tiny` does not run in llama.cpp: its mrope sections exceed its rotary dims); the
vendored convert_hf_to_gguf.py, in its own venv (transformers 4.x), turns a copy of the release (head
files left out, tokenizer class Qwen2TokenizerFast, big files symlinked) into a BF16 GGUF, which
llama-quantize turns into Q8_0 and Q4_0. Ours also converts the release to an 8-bit bundle
(`clef-flash convert`), timed as `bundle:PRECISION`.

Measured, on --threads threads (default 2): llama.cpp's prompt processing, `llama-bench -p 370 -n 0 -r 3`
(default weight repacking; tokens/s, llama-bench's mean of 3 after its warm-up), for BF16, Q8_0 and Q4_0;
ours, the whole record end to end: `model.answer(request)` for one record of at most 370 tokens with three
questions (tokenize, decoder, head, response body), median of --repeats after one warm-up; tokens/s =
record tokens / wall seconds. llama.cpp computes logits for the last token only; ours also tokenizes, runs
the joint head and builds the response body. Each measurement runs in its own process; a round runs every llama.cpp
format then every precision of ours, and the table gives the median over --rounds rounds and each of ours
against llama.cpp's fastest format (> 1: ours is faster). Refuses to start timing while the 1-minute load
average is above 0.5 (--force: time anyway); the load before each round is reported (from round 2 on it
includes the previous round's own work).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER = HERE / ".peer"
VERSION = "0.3.36"
SOURCE = PEER / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
BUILD = PEER / "build"
BIN = BUILD / "bin"
VENV = PEER / "convert-venv"
FORMATS = ("BF16", "Q8_0", "Q4_0")
HEAD_FILES = ("joint_head.safetensors", "joint_head_config.json")
BUNDLE = "bundle:"  # --precisions prefix: run our 8-bit bundle of the release
MAX_LOAD = 0.5


def output_of(command: list) -> str:
    """The stdout of a command; when it fails, exit with the tail of its stderr."""
    done = subprocess.run([str(part) for part in command], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{Path(command[0]).name} failed (exit status {done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def run(command: list, *, quiet: bool = False) -> None:
    """A setup step, echoed; a quiet one shows its output only when it fails."""
    print("+", " ".join(str(part) for part in command), flush=True)
    if quiet:
        output_of(command)
    elif subprocess.run([str(part) for part in command]).returncode:
        sys.exit(f"{Path(command[0]).name} failed")


def fetch_source() -> None:
    """The llama-cpp-python sdist from PyPI, unpacked; llama.cpp is under vendor/llama.cpp."""
    if (SOURCE / "CMakeLists.txt").exists():
        return
    sdist = PEER / "sdist"
    run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
         f"llama-cpp-python=={VERSION}", "-d", sdist])
    with tarfile.open(sdist / f"llama_cpp_python-{VERSION}.tar.gz") as archive:
        archive.extractall(PEER, filter="tar")


def build_llama() -> None:
    """llama-bench and llama-quantize, CPU only, tuned for this CPU (5 to 10 minutes on 2 cores).

    Without the AMX kernels: on an AMX Xeon, this llama.cpp's AMX matmul (which takes Q8_0 and Q4_0 under
    the default repacking) crashes on this model, SIGSEGV or SIGILL in ggml_backend_amx_mul_mat (cf.
    llama.cpp issue #20824), so Q8_0 and Q4_0 run the AVX-512 repacked kernels instead, as on a CPU
    without AMX. (`--repack 0` also avoids the crash, but gives up the repacked kernels.)"""
    if all((BIN / name).exists() for name in ("llama-bench", "llama-quantize")):
        return
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    run(["cmake", "-S", SOURCE, "-B", BUILD, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF",
         "-DGGML_VULKAN=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"])
    run(["cmake", "--build", BUILD, "--target", "llama-bench", "llama-quantize", "-j", "2"])


def converter_venv() -> Path:
    """A venv for convert_hf_to_gguf.py: the CPU torch wheel first (a looser pin pulls CUDA), then the rest."""
    python = VENV / "bin" / "python"
    if (VENV / ".installed").exists():
        return python
    run([sys.executable, "-m", "venv", VENV])
    run([python, "-m", "pip", "install", "torch==2.13.0"])
    run([python, "-m", "pip", "install", "transformers>=4.57,<5", "numpy", "sentencepiece", "safetensors",
         "protobuf>=4.21,<5", SOURCE / "gguf-py"])
    (VENV / ".installed").touch()
    return python


def write_release(config: str) -> Path:
    """Our random release, written once (to a temporary name, renamed when complete)."""
    release = PEER / f"release-{config}"
    if not (release / "config.json").exists():
        partial = release.with_name(release.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        run([Path(sys.executable).with_name("clef-flash"), "tiny", partial, "--config", config])
        partial.rename(release)
    return release


def converter_copy(release: Path) -> Path:
    """The release as the converter wants it: no head files, tokenizer class Qwen2TokenizerFast (the
    release names Qwen3_5Tokenizer, which transformers 4.x lacks); everything else symlinked."""
    copy = PEER / f"hf-{release.name.removeprefix('release-')}"
    copy.mkdir(exist_ok=True)
    for path in release.iterdir():
        target = copy / path.name
        if path.name in HEAD_FILES or path.name == "tokenizer_config.json" or target.exists():
            continue
        target.symlink_to(path.resolve())
    tokenizer_config = json.loads((release / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "Qwen2TokenizerFast"
    (copy / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return copy


def convert(release: Path, python: Path) -> dict[str, Path]:
    """BF16 GGUF by the vendored converter, Q8_0 and Q4_0 from it by llama-quantize."""
    folder = PEER / f"gguf-{release.name.removeprefix('release-')}"
    folder.mkdir(exist_ok=True)
    ggufs = {name: folder / f"{name.lower()}.gguf" for name in FORMATS}
    for name, gguf in ggufs.items():
        if gguf.exists():
            continue
        partial = gguf.with_suffix(".partial")
        if name == "BF16":
            run([python, SOURCE / "convert_hf_to_gguf.py", converter_copy(release), "--outtype", "bf16",
                 "--outfile", partial], quiet=True)
        else:
            run([BIN / "llama-quantize", ggufs["BF16"], partial, name, "2"], quiet=True)
        partial.rename(gguf)
    return ggufs


def write_bundle(release: Path) -> Path:
    """Our 8-bit bundle of the release (`clef-flash convert`)."""
    bundle = PEER / f"bundle-{release.name.removeprefix('release-')}"
    if not (bundle / "manifest.json").exists():
        run([Path(sys.executable).with_name("clef-flash"), "convert", release, bundle, "--overwrite"])
    return bundle


def setup(config: str) -> tuple[Path, Path, dict[str, Path]]:
    PEER.mkdir(exist_ok=True)
    fetch_source()
    build_llama()
    release = write_release(config)
    return release, write_bundle(release), convert(release, converter_venv())


def time_llama(gguf: Path, tokens: int, threads: int) -> dict:
    """llama-bench prompt processing of `tokens` tokens: tokens/s (mean of 3 repetitions)."""
    command = [BIN / "llama-bench", "-m", gguf, "-p", str(tokens), "-n", "0", "-t", str(threads), "-r", "3",
               "-o", "json"]
    result = json.loads(output_of(command))[0]
    return {"tokens": result["n_prompt"], "tokens_per_s": result["avg_ts"], "samples_ts": result["samples_ts"],
            "build": result["build_commit"]}


def request_of(model, tokens: int) -> dict:
    """Three questions and a state of words, the most words that keep the record within `tokens` tokens."""
    from clef_flash.request.samples import request_of_tokens

    return request_of_tokens(lambda request: model.encode(request).token_count, tokens)


def time_ours(args) -> None:
    """Child process: one precision of ours, one record end to end; prints one JSON line."""
    import torch

    import clef_flash

    torch.set_num_threads(args.threads)
    model = clef_flash.load(args.release, device="cpu", precision=None if args.ours == "default" else args.ours)
    request = request_of(model, args.tokens)
    tokens = model.encode(request).token_count
    model.answer(request)  # warm-up
    seconds = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        model.answer(request)
        seconds.append(time.perf_counter() - started)
    print(json.dumps({"tokens": tokens, "tokens_per_s": tokens / statistics.median(seconds),
                      "resolved_precision": model.precision, "seconds": seconds}))


def ours(release: Path, precision: str, args) -> dict:
    """Our run of one precision, in a process of its own."""
    command = [sys.executable, __file__, "--ours", precision, "--release", str(release), "--tokens",
               str(args.tokens), "--threads", str(args.threads), "--repeats", str(args.repeats)]
    return json.loads(output_of(command).strip().splitlines()[-1])


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def summarize(rounds: list[dict]) -> dict[str, dict]:
    """Median tokens/s per engine and format over rounds, and ours against llama.cpp's fastest format."""
    rows = {}
    for engine in ("llama.cpp", "ours"):
        for name in rounds[0][engine]:
            runs = [one_round[engine][name] for one_round in rounds]
            rows[f"{engine} {name}"] = {"engine": engine, "format": name, "tokens": runs[0]["tokens"],
                                        "tokens_per_s": statistics.median(run["tokens_per_s"] for run in runs),
                                        "per_round": [run["tokens_per_s"] for run in runs]}
    fastest = max((row for row in rows.values() if row["engine"] == "llama.cpp"), key=lambda row: row["tokens_per_s"])
    for row in rows.values():
        if row["engine"] == "ours":
            row["vs_llama_fastest"] = row["tokens_per_s"] / fastest["tokens_per_s"]
    return rows


def markdown(rows: dict[str, dict]) -> str:
    lines = ["| engine | format | tokens | tokens/s (median) | per round | vs llama.cpp fastest |",
             "|---|---|---:|---:|---|---:|"]
    for row in rows.values():
        ratio = f"{row['vs_llama_fastest']:.2f}x" if "vs_llama_fastest" in row else ""
        per_round = ", ".join(f"{value:.1f}" for value in row["per_round"])
        lines.append(f"| {row['engine']} | {row['format']} | {row['tokens']} | {row['tokens_per_s']:.1f} | "
                     f"{per_round} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="9b-part", help="random config for `clef-flash tiny`")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--precisions",
        default="default,bf16,bundle:default,bundle:int8-weight-only",
        help="ours: precisions of the release, or bundle:PRECISION of its 8-bit bundle; default: precision=None",
    )
    parser.add_argument("--tokens", type=int, default=370, help="prompt tokens (llama.cpp) / most record tokens (ours)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed answers per run of ours (median)")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--force", action="store_true", help=f"time even when the load average is above {MAX_LOAD}")
    parser.add_argument("--setup-only", action="store_true", help="build and convert, time nothing")
    parser.add_argument("--ours", help=argparse.SUPPRESS)
    parser.add_argument("--release", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ours:
        time_ours(args)
        return

    release, bundle, ggufs = setup(args.config)
    if args.setup_only:
        print(f"ready: {BIN / 'llama-bench'}, {release}, {bundle}, " + ", ".join(str(path) for path in ggufs.values()))
        return
    load = os.getloadavg()[0]
    if load > MAX_LOAD and not args.force:
        sys.exit(f"1-minute load average is {load:.2f} (> {MAX_LOAD}): this machine is busy, not timing "
                 "(wait for it to be quiet, or --force)")

    rounds = []
    for number in range(1, args.rounds + 1):
        one_round = {"load_avg_1min": os.getloadavg()[0], "llama.cpp": {}, "ours": {}}
        print(f"round {number}/{args.rounds} (load {one_round['load_avg_1min']:.2f})", flush=True)
        for name, gguf in ggufs.items():
            one_round["llama.cpp"][name] = time_llama(gguf, args.tokens, args.threads)
        for precision in args.precisions.split(","):
            source = bundle if precision.startswith(BUNDLE) else release
            one_round["ours"][precision] = ours(source, precision.removeprefix(BUNDLE), args)
        rounds.append(one_round)

    rows = summarize(rounds)
    result = {"cpu": cpu_name(), "threads": args.threads, "config": args.config, "release": str(release),
              "llama_cpp": f"llama-cpp-python {VERSION} vendored, build {rounds[0]['llama.cpp']['BF16']['build']}",
              "rounds": rounds, "rows": rows}
    loads = ", ".join(f"{one_round['load_avg_1min']:.2f}" for one_round in rounds)
    resolved = {name: run["resolved_precision"] for name, run in rounds[0]["ours"].items() if "default" in name}
    print(f"\n{result['cpu']}, {args.threads} threads; {args.config} release; {args.rounds} rounds "
          f"(1-minute load before each: {loads}); defaults resolved to {resolved}\n")
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
