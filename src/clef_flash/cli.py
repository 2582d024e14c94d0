"""The `clef-flash` command: a thin layer over the Python API.

    clef-flash tiny DIR                       write a random release (real vocabulary) for smoke tests
    clef-flash answer --model SRC [REQUEST]   answer a System One request (file, stdin, or flags)
    clef-flash render [REQUEST]               show the rendered prompt, spans and token counts
    clef-flash serve --model SRC              a System One HTTP server, with a triage demo page at /; --ray: Ray Serve
    clef-flash mcp --model SRC                the model as MCP tools for agents (decide, classify, one per set): stdio, or --http PORT
    clef-flash sets add|list|rm               saved question sets: answer --set, POST /v1/sets/NAME, batch --set, MCP
    clef-flash batch IN OUT --model SRC       JSONL requests (or states + --schema) to JSONL answers; resumable;
                                              --ray: on a Ray cluster (Ray Data), the same output
    clef-flash eval agreement REQUESTS        --model A vs --against-model B: answers that differ, |dp|, near-ties
    clef-flash eval labelled FILE --model SRC accuracy, macro-F1, log-loss, Brier, ECE, a reliability diagram
    clef-flash bench [--random NAME]          latency percentiles, records/s, tokens/s, peak RSS
    clef-flash convert SRC DST                a release to an 8-bit bundle (memory-mapped, int8 smoothed and rotated)
    clef-flash export coreml SRC DST          the Core ML packages of a release or bundle (runs on macOS)
    clef-flash info                           this machine's features and probe, the default precision and why

Environment defaults: CLEF_FLASH_MODEL (--model), CLEF_FLASH_DEVICE (--device),
CLEF_FLASH_PRECISION (--precision; also what `load(precision=None)` runs), CLEF_FLASH_API_KEY (serve and mcp --api-key),
CLEF_FLASH_SETS_DIR (where the saved question sets are; default: sets/ in the user's config directory).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .console import bar
from .errors import ClefError, RequestInvalid
from .checkpoint.coreml_layout import DEFAULT_BUCKETS, HEAD_OPTIONS, HEAD_QUESTIONS, RUNNERS
from .model.precision import PRECISION_CHOICES


# -- building a request from flags ---------------------------------------------------------------


def parse_question_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """`id=type:instructions[:criteria]` -> (id, question).

    noul:   `urgent=noul:Is it urgent?`
    choice: `team=choice:Which team?:billing=Charges,engineering=Bugs,other` (a bare label: no description)
    score:  `urgency=score:How urgent?:Low,Normal,High` (levels low to high)
    The instructions may contain ':'; the criteria are what follows the last ':'.
    """
    question_id, equals, rest = spec.partition("=")
    kind, colon, rest = rest.partition(":")
    kind = kind.strip()
    if not equals or not question_id or not colon or kind not in ("noul", "choice", "score"):
        raise ClefError(
            f"bad --question {spec!r}: write ID=TYPE:INSTRUCTIONS[:CRITERIA] with TYPE noul, choice or score, "
            "e.g. team=choice:Which team?:billing=Charges,engineering=Bugs"
        )
    if kind == "noul":
        return question_id, {"type": "noul", "instructions": rest}
    instructions, colon, criteria_text = rest.rpartition(":")
    if not colon or not criteria_text.strip():
        raise ClefError(f"bad --question {spec!r}: a {kind} question needs its options after a last ':'")
    items = [item.strip() for item in criteria_text.split(",") if item.strip()]
    if kind == "score":
        return question_id, {"type": "score", "instructions": instructions, "criteria": items}
    criteria: dict[str, str | None] = {}
    for item in items:
        label, has_description, description = item.partition("=")
        criteria[label.strip()] = description.strip() if has_description else None
    return question_id, {"type": "choice", "instructions": instructions, "criteria": criteria}


def decode_utf8(data: bytes, where: str) -> str:
    """`data` as text, or one line naming `where` and the byte offset of the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ClefError(
            f"{where} is not UTF-8 text: byte 0x{data[error.start]:02x} at offset {error.start} ({error.reason}); "
            "convert it first, e.g. iconv -f latin1 -t utf-8"
        ) from None


def read_stdin() -> str:
    if sys.stdin.isatty():
        raise ClefError("no request: give a JSON file, pipe one on stdin, or use --state and --question")
    stream = getattr(sys.stdin, "buffer", None)  # bytes: the locale's decoding would hide the offset
    return decode_utf8(stream.read(), "stdin") if stream is not None else sys.stdin.read()


def read_request(args: argparse.Namespace) -> Any:
    """The request body from --state/--question flags (or --set), a file, or stdin; --image and --video paths join
    its images and videos."""
    request = _read_request_body(args)
    for flag, field in (("image", "images"), ("video", "videos")):
        paths = getattr(args, flag, None)
        if not paths:
            continue
        if not isinstance(request, dict):
            raise ClefError(f"--{flag} needs a request object")
        for path in paths:
            if not Path(path).is_file():
                raise ClefError(f"no {flag} file at {path}")
        request = {**request, field: [*(request.get(field) or []), *map(Path, paths)]}
    return request


def _read_request_body(args: argparse.Namespace) -> Any:
    if args.state is not None or args.state_file is not None or args.question or getattr(args, "set", None):
        if args.request:
            raise ClefError("give either a request file or --state/--question/--set flags, not both")
        if args.set and args.question:
            raise ClefError(f"--set {args.set} brings its own questions: drop --question, or drop --set")
        if args.state_file is not None:
            state: Any = decode_utf8(Path(args.state_file).read_bytes(), args.state_file)
        elif args.state is not None:
            state = args.state
        else:
            raise ClefError(f"{'--set' if args.set else '--question'} needs a state: add --state TEXT or --state-file FILE")
        if args.set:
            from .sets import SetStore

            return SetStore().get(args.set).request(state)
        if not args.question:
            raise ClefError("add at least one --question, e.g. --question 'urgent=noul:Is it urgent?'")
        questions = dict(parse_question_spec(spec) for spec in args.question)
        return {"model": "clef-flash", "state": state, "questions": questions}
    if args.request and args.request != "-":
        path = Path(args.request)
        if not path.is_file():
            raise ClefError(f"no request file at {path}")
        text, where = decode_utf8(path.read_bytes(), str(path)), str(path)
    else:
        text, where = read_stdin(), "stdin"
    try:
        return json.loads(text)
    except ValueError as exc:  # not JSON, or an integer past Python's digit limit
        raise ClefError(f"{where} is not JSON: {exc}") from exc


# -- output --------------------------------------------------------------------------------------


def format_answers(body: dict[str, Any], *, random_weights: bool) -> str:
    lines = []
    if random_weights:
        lines.append("(random weights: these answers mean nothing; use --model Cloudflare/clef-flash for the real model)")
    for question_id, answer in body["answers"].items():
        kind = answer["type"]
        if kind == "noul":
            p_true = answer["noul"]
            verdict = "yes" if p_true >= 0.5 else "no"
            lines.append(f"{question_id}  (noul)  -> {verdict}")
            probabilities = {"true": p_true, "false": round(1 - p_true, 4)}
        elif kind == "choice":
            lines.append(f"{question_id}  (choice)  -> {answer['choice']}  (confidence {answer['confidence']:.4f})")
            probabilities = answer["probabilities"]
        else:
            lines.append(f"{question_id}  (score)  -> {answer['score']:.4f}  (confidence {answer['confidence']:.4f})")
            probabilities = {f"{level} {answer['legend'][level]}": p for level, p in answer["probabilities"].items()}
        width = max(len(str(option)) for option in probabilities)
        for option, probability in probabilities.items():
            lines.append(f"    {str(option):<{width}}  {bar(probability)}  {probability:.4f}")
    lines.append(f"input tokens: {body['usage']['input_tokens']}")
    return "\n".join(lines)


def format_timings(timings: dict[str, float]) -> str:
    return "  ".join(f"{name.removesuffix('_ms')} {value:.1f} ms" for name, value in timings.items() if name.endswith("_ms"))


# -- commands ------------------------------------------------------------------------------------


def command_tiny(args: argparse.Namespace) -> int:
    from .checkpoint.random_release import write_random_release

    out = write_random_release(args.dir, args.config, seed=args.seed)
    print(f"wrote a random {args.config!r} release (seed {args.seed}) to {out}")
    return 0


def command_convert(args: argparse.Namespace) -> int:
    from .checkpoint.bundle import verify_checksums
    from .conversion import convert

    start = time.perf_counter()
    out = convert(args.source, args.destination, revision=args.revision, overwrite=args.overwrite)
    verify_checksums(out)
    size = sum(path.stat().st_size for path in out.iterdir())
    print(
        f"wrote an {args.precision} bundle to {out} ({size / 1e9:.2f} GB, "
        f"{time.perf_counter() - start:.1f} s, checksums verified)"
    )
    return 0


def command_export_coreml(args: argparse.Namespace) -> int:
    from .coreml.export import export_coreml

    report = export_coreml(
        args.source,
        args.destination,
        buckets=args.buckets,
        head_questions=args.head_questions,
        head_options=args.head_options,
        overwrite=args.overwrite,
        log=lambda message: print(message, file=sys.stderr),
    )
    sizes = ", ".join(f"{name} {size / 1e6:,.1f} MB" for name, size in report["files"].items())
    print(
        f"wrote the Core ML packages to {args.destination} ({sizes}; {report['seconds']['total']:.1f} s, "
        f"peak RSS {report['peak_rss_mb']:,} MB). Run them on a Mac: clef-flash answer --model {args.destination} ..."
    )
    return 0


def bucket_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"buckets are comma-separated token counts, e.g. 256,512,1024; got {text!r}") from None


def load_model(args: argparse.Namespace, **options: Any):
    """`load(--model, --device, --precision, --revision, --verify, --resident-layers, --state-cache-mb,
    --segment-tokens, --adapter)` plus `options`."""
    from .checkpoint.adapters import adapter_options
    from .loader import load
    from .prefill import DEFAULT_SEGMENT_TOKENS

    options = {**adapter_options(getattr(args, "adapter", None)), **options}
    return load(
        args.model,
        device=args.device,
        precision=args.precision,
        revision=args.revision,
        verify=getattr(args, "verify", False),
        resident_layers=getattr(args, "resident_layers", None),
        state_cache_mb=getattr(args, "state_cache_mb", None),
        segment_tokens=getattr(args, "segment_tokens", None) or DEFAULT_SEGMENT_TOKENS,
        coreml_runner=getattr(args, "coreml_runner", None),
        **options,
    )


def answer_truncating(model: Any, request: Any) -> dict[str, Any]:
    """`model.answer`, with the state's tail cut to fit the token limit (said on stderr)."""
    from .engine import Timings

    start = time.perf_counter()
    timings = Timings()
    prepared = model.prepare(request, truncate_state=True)  # the backend's checks too (a Core ML export's buckets)
    timings.tokenize_ms = (time.perf_counter() - start) * 1000
    (results,) = model.score([prepared.record], timings)
    timings.total_ms = (time.perf_counter() - start) * 1000
    model.last_timings = timings
    record = prepared.record
    print(
        f"--truncate-state: cut {record.state_tokens_dropped} tokens from the state's end "
        f"(kept {record.state_tokens}; {record.token_count} of {model.max_length} in all)",
        file=sys.stderr,
    )
    return model.respond(prepared, results)


def command_answer(args: argparse.Namespace) -> int:
    from .request.records import DEFAULT_MAX_LENGTH

    request = read_request(args)
    model = load_model(args, max_length=args.max_length or DEFAULT_MAX_LENGTH)
    body = answer_truncating(model, request) if args.truncate_state else model.answer(request)
    if args.json or (not sys.stdout.isatty() and not args.table):
        output = dict(body)
        if args.timings:
            output = {**output, "timings": model.last_timings.as_dict()}
        print(json.dumps(output, ensure_ascii=False, indent=None if not sys.stdout.isatty() else 2))
    else:
        print(format_answers(body, random_weights=model.is_random))
        if args.timings:
            print(format_timings(model.last_timings.as_dict()))
    return 0


def command_serve(args: argparse.Namespace) -> int:
    from .request.records import DEFAULT_MAX_LENGTH

    check_ray_flags(args, "--address", "--replicas", "--cpus-per-worker", "--gpus-per-worker")
    settings = {
        "api_key": args.api_key or None,
        "max_body_bytes": args.max_body_bytes,
        "max_image_body_bytes": max(args.max_image_body_bytes, args.max_body_bytes),
        "max_video_body_bytes": max(args.max_video_body_bytes, args.max_image_body_bytes, args.max_body_bytes),
        "batch_tokens": args.batch_tokens,
        "batch_wait_ms": args.batch_wait_ms,
        "max_batch": args.max_batch,
        "max_queue": args.max_queue,
        "max_parsing_bytes": args.max_parsing_bytes,
        "request_timeout_s": args.request_timeout,
        "header_timeout_s": args.header_timeout,
        "body_timeout_s": args.body_timeout,
        "max_connections": args.max_connections,
        "shutdown_timeout_s": args.shutdown_timeout,
    }
    if args.ray:
        spec = engine_spec(args, max_length=args.max_length or DEFAULT_MAX_LENGTH)
        from .distributed.ray_serve import serve_on_ray

        replicas = args.replicas or 1
        print(
            f"serving {spec.source} ({spec.precision}, {replicas} replica{'s' * (replicas > 1)} on Ray) "
            f"on http://{args.host}:{args.port}/",
            file=sys.stderr,
        )
        serve_on_ray(
            spec,
            settings,
            host=args.host,
            port=args.port,
            address=args.address,
            replicas=replicas,
            cpus_per_replica=args.cpus_per_worker or 1.0,
            gpus_per_replica=args.gpus_per_worker or 0.0,
        )
        return 0
    from .server import serve

    model = load_model(args, max_length=args.max_length or DEFAULT_MAX_LENGTH)
    meaning = ": the answers mean nothing" if model.is_random else ""
    print(f"serving {model!r} on http://{args.host}:{args.port}/{meaning}", file=sys.stderr)
    serve(model, host=args.host, port=args.port, log_level=args.log_level, **settings)
    return 0


def command_mcp(args: argparse.Namespace) -> int:
    import anyio

    from .request.records import DEFAULT_MAX_LENGTH
    from .server.app import ServerSettings
    from .server.mcp_tools import ToolServer, uvicorn_server

    settings = ServerSettings(
        api_key=args.api_key or None,
        batch_tokens=args.batch_tokens,
        batch_wait_ms=args.batch_wait_ms,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
    )
    model = load_model(args, max_length=args.max_length or DEFAULT_MAX_LENGTH)
    tools = ToolServer(model, settings)
    meaning = ": the answers mean nothing" if model.is_random else ""
    sets = ", ".join(tools.sets.names()) or "none"
    if args.http is None:
        print(f"MCP over stdio: {model!r}{meaning}; saved sets: {sets}", file=sys.stderr)
        anyio.run(tools.serve_stdio)
        return 0
    key = ", bearer key required" if settings.api_key else ""
    print(f"MCP on http://{args.host}:{args.http}/mcp{key}: {model!r}{meaning}; saved sets: {sets}", file=sys.stderr)
    uvicorn_server(tools.http_app(host=args.host), host=args.host, port=args.http, log_level=args.log_level).run()
    return 0


def command_sets_add(args: argparse.Namespace) -> int:
    from .sets import SetStore

    path = Path(args.schema)
    if not path.is_file():
        raise ClefError(f"no schema file at {path}")
    try:
        schema = json.loads(decode_utf8(path.read_bytes(), str(path)))
    except ValueError as error:
        raise ClefError(f"{path} is not JSON: {error}") from None
    store = SetStore()
    try:
        saved = store.add(args.name, schema, replace=args.replace)
    except RequestInvalid:
        print(f"error: {path} is not saved as set {args.name!r}:", file=sys.stderr)
        raise
    print(f"saved {saved.name}: {saved.describe()} ({store.path(saved.name)})")
    return 0


def command_sets_list(args: argparse.Namespace) -> int:
    from .sets import SetStore

    store = SetStore()
    saved = store.all()
    if args.json:
        print(json.dumps([question_set.to_file() for question_set in saved], ensure_ascii=False))
        return 0
    if not saved:
        print(f"no saved question sets in {store.root}; add one with `clef-flash sets add NAME schema.json`", file=sys.stderr)
    for question_set in saved:
        print(f"{question_set.name}  {question_set.describe()}")
    return 0


def command_sets_rm(args: argparse.Namespace) -> int:
    from .sets import SetStore

    SetStore().remove(args.name)
    print(f"removed {args.name}")
    return 0


def check_ray_flags(args: argparse.Namespace, *flags: str) -> None:
    """Flags that only mean something on Ray need --ray; --ray needs Ray installed (one line if not)."""
    if args.ray:
        from .distributed import require_ray

        require_ray()
        return
    given = [flag for flag in flags if getattr(args, flag.lstrip("-").replace("-", "_")) is not None]
    if given:
        raise ClefError(f"{', '.join(given)} {'need' if len(given) > 1 else 'needs'} --ray")


def engine_spec(args: argparse.Namespace, **options: Any):
    """What each Ray worker loads: --model and the precision resolved here, once, for the workers'
    device (cuda with --gpus-per-worker, else cpu); never weights."""
    from .distributed import EngineSpec

    device = "cuda" if args.gpus_per_worker else "cpu"
    if args.device not in ("auto", device):
        raise ClefError(f"on Ray the workers' device follows --gpus-per-worker ({device} here), not --device {args.device}")
    return EngineSpec.resolve(
        args.model,
        precision=args.precision,
        device=device,
        revision=args.revision,
        state_cache_mb=args.state_cache_mb,
        segment_tokens=args.segment_tokens,
        resident_layers=args.resident_layers,
        coreml_runner=args.coreml_runner,
        **options,
    )


def command_render(args: argparse.Namespace) -> int:
    from .checkpoint.sources import processor_configs, resolve_source
    from .request.protocol import parse_request
    from .request.images import ImageProcessorConfig
    from .request.records import DEFAULT_MAX_LENGTH, encode_record, marked_text
    from .request.tokenizer import Tokenizer
    from .request.videos import VideoProcessorConfig

    request = parse_request(read_request(args))
    root = resolve_source(args.model, revision=args.revision)
    tokenizer = Tokenizer.from_file(root / "tokenizer.json")
    configs = processor_configs(root)
    image_config, video_config = configs["processor_config"], configs["video_processor_config"]
    limit = args.max_length or DEFAULT_MAX_LENGTH
    record = encode_record(
        tokenizer,
        request,
        max_length=limit,
        truncate_state=args.truncate_state,
        image_processor=None if image_config is None else ImageProcessorConfig.from_dict(image_config),
        video_processor=None if video_config is None else VideoProcessorConfig.from_dict(video_config),
    )
    print(marked_text(tokenizer, record))
    cut = f" ({record.state_tokens_dropped} cut from its end)" if args.truncate_state else ""
    images = ""
    if record.media is not None:
        kinds = " and ".join(kind for kind, count in (("images", record.media.image_count), ("videos", len(record.media.times))) if count)
        images = f" ({kinds} {record.media.tokens})"
    print(
        f"\n--- tokens: prefix {record.prefix_tokens}{images}, state {record.state_tokens}{cut}, schema {record.schema_tokens}, "
        f"suffix {record.suffix_tokens}; total {record.token_count} of {limit}",
        file=sys.stderr,
    )
    return 0


def command_batch(args: argparse.Namespace) -> int:
    from .batch import BatchJob
    from .console import ProgressBar
    from .request.records import DEFAULT_MAX_LENGTH

    from .checkpoint import open_checkpoint
    from .loader import plan_of
    from .model.precision import COREML_PRECISION

    check_ray_flags(args, "--address", "--workers", "--cpus-per-worker", "--gpus-per-worker")
    max_length = args.max_length or DEFAULT_MAX_LENGTH
    # The precision as resolved on this machine, not as asked: a job resumed on another kind of CPU,
    # whose default differs, is refused instead of mixing precisions in one output.
    if args.ray:
        spec = engine_spec(args, max_length=max_length)
        resolved = spec.precision
    else:
        checkpoint = open_checkpoint(args.model, revision=args.revision)
        resolved = plan_of(checkpoint, device=args.device, precision=args.precision, coreml_runner=args.coreml_runner).name
    if resolved != COREML_PRECISION.name:
        args.precision = resolved  # load what was recorded (a Core ML export runs as exported: no precision)
    made_with = {"source": args.model, "revision": args.revision, "precision": resolved, "max_length": args.max_length}
    schemas = [schema_file(item) for item in args.schema] if args.schema else None
    job = BatchJob.open(args.input, args.output, schema_path=schemas, model=made_with, overwrite=args.overwrite)
    total = job.total()
    if job.done:
        print(f"resuming: {len(job.done)} of {total} lines are already in {args.output}", file=sys.stderr)
    if not job.fresh and len(job.done) == total:
        return 0
    progress = ProgressBar(total, "batch", done=len(job.done))
    if args.ray:
        from .distributed.ray_batch import run_ray_batch

        summary = run_ray_batch(
            job,
            spec,
            batch_size=args.batch_size,
            workers=args.workers or 1,
            cpus_per_worker=args.cpus_per_worker,
            gpus_per_worker=args.gpus_per_worker or 0.0,
            address=args.address,
            progress=progress,
        )
    else:
        summary = job.run(load_model(args, max_length=max_length), batch_size=args.batch_size, progress=progress)
    print(
        f"wrote {summary.written} lines ({summary.errors} errors) to {args.output} in {summary.seconds:.1f} s",
        file=sys.stderr,
    )
    return 0


class SetName(str):
    """A `batch --set NAME`, in the list of --schema files (the positions count both)."""


def schema_file(item: str) -> str:
    """A --schema file, or the file of a --set (checked first: a damaged set is refused by name).
    A set's file is a schema file: its other keys (format, name, description) are not a request's."""
    if not isinstance(item, SetName):
        return item
    from .sets import SetStore

    store = SetStore()
    store.get(item)
    return str(store.path(item))


def write_report(args: argparse.Namespace, report: dict[str, Any], markdown: str, figure: tuple[str, Callable[[], Any]]) -> None:
    """The Markdown report on stdout; with --out, report.json, report.md and the figure (file name,
    a function drawing it) in that directory."""
    from . import plots
    from .evaluate import write_reports

    print(markdown, end="")
    if args.out:
        name, draw = figure
        written = write_reports(args.out, report, markdown, {name: plots.png(draw())})
        print(f"wrote {', '.join(str(path) for path in written)}", file=sys.stderr)


def command_eval_agreement(args: argparse.Namespace) -> int:
    from .loader import load
    from .evaluate import agreement_markdown, evaluate_agreement
    from .plots import agreement_figure

    report = evaluate_agreement(
        args.requests,
        lambda: load_model(args),
        lambda: load(
            args.against_model, device=args.device, precision=args.against_precision, revision=args.against_revision
        ),
        near_tie=args.near_tie,
    )
    write_report(args, report, agreement_markdown(report), ("agreement.png", lambda: agreement_figure(report)))
    return 0


def command_eval_labelled(args: argparse.Namespace) -> int:
    from .evaluate import evaluate_labelled, labelled_markdown
    from .plots import reliability_figure

    if args.adapter:  # base vs tuned, side by side, from one copy of the base
        from .checkpoint.adapters import side_by_side
        from .evaluate import base_vs_tuned_markdown, evaluate_base_vs_tuned

        name, adapters = side_by_side(args.adapter)
        args.adapter = None
        report = evaluate_base_vs_tuned(args.file, load_model(args, adapters=adapters), name)
        figure = ("reliability.png", lambda: reliability_figure(report["tuned"]["reliability"]))
        write_report(args, report, base_vs_tuned_markdown(report), figure)
        return 0
    report = evaluate_labelled(args.file, lambda: load_model(args))
    write_report(args, report, labelled_markdown(report), ("reliability.png", lambda: reliability_figure(report["reliability"])))
    return 0


def command_info(args: argparse.Namespace) -> int:
    import torch

    from . import machine
    from .model.precision import choose_precision

    here = machine.this_machine()
    if args.reprobe:
        machine.forget_rates(here)
    measured = machine.rates(here)
    device = torch.device("cpu")
    defaults = {
        kind: choose_precision(device, stored_int8=stored, rates=lambda: measured)
        for kind, stored in (("release", False), ("bundle", True))
    }
    report = {
        **machine.describe(here, measured),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "default_precision": {kind: {"precision": value.name, "why": value.reason} for kind, value in defaults.items()},
    }
    if args.adapter:  # checked against --model's config, the base not built
        from .checkpoint import open_checkpoint
        from .checkpoint.adapters import adapter_name_of, adapter_options, read_adapters

        options = adapter_options(args.adapter)
        paths = {**({adapter_name_of(options["adapter"]): options["adapter"]} if "adapter" in options else {}), **options.get("adapters", {})}
        report["adapters"] = [item.describe() for item in read_adapters(open_checkpoint(args.model), paths).values()]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    features = ", ".join(here.features) or "none of " + ", ".join(machine.FEATURE_FLAGS)
    probe = report["probe"]
    print(f"CPU          {here.cpu} ({features})")
    print(f"torch        {here.torch}, kernels for {here.cpu_capability}, oneDNN {'yes' if here.onednn else 'no'}, {here.threads} threads")
    print(f"CUDA         {report['cuda'] or 'none'}")
    print(
        f"probe        fp32 {probe['fp32_gflops']:.0f} GFLOP/s, bf16 {probe['bf16_gflops']:.0f} GFLOP/s, "
        f"int8 {probe['int8_gops']:.0f} GOP/s ({probe['int8_kernel']}); {machine.PROBE_SHAPE[0]} tokens x "
        f"{machine.PROBE_SHAPE[1]} -> {machine.PROBE_SHAPE[2]}"
    )
    for name, gops in probe["int8_kernels_gops"].items():
        print(f"W8A8 kernel  {name}: exact here, {machine.kernel_note(name, gops, probe['fp32_gflops'])}")
    for name, why in probe["int8_excluded"].items():
        print(f"W8A8 kernel  {name}: excluded, {why}")
    for kind, value in defaults.items():
        print(f"default      {kind}: {value.name} ({value.reason})")
    for adapter in report.get("adapters", []):
        print(f"adapter      {adapter['name']}: rank {adapter['rank']}, {adapter['projections']} projections, {adapter['bytes'] / 2**20:.1f} MiB ({adapter['path']})")
    return 0


def command_bench(args: argparse.Namespace) -> int:
    from .batch import read_jsonl
    from .bench import bench, format_bench, generated_requests
    from .checkpoint.adapters import adapter_options
    from .loader import load

    requests = [request for _, request in read_jsonl(args.requests)] if args.requests else None
    if args.random:
        source = f"random:{args.random}" + (f":{args.seed}" if args.seed else "")
        model = load(source, device=args.device, precision=args.precision, **adapter_options(args.adapter))
    else:
        model = load_model(args)
    if requests is None:
        requests = generated_requests(model, records=args.records, tokens=args.tokens, seed=args.seed)
    results = []
    for batch_size in args.batch_size:
        results.append(bench(model, requests, batch_size=batch_size))
        print(json.dumps(results[-1]) if args.json else format_bench(results[-1]), flush=True)
    if args.plot:
        from .plots import bench_figure, png

        Path(args.plot).write_bytes(png(bench_figure(results)))
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be more than 0; got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 or more; got {text}")
    return value


def positive_ints(text: str) -> list[int]:
    """`4` or `1,2,4,8`."""
    return [positive_int(part) for part in text.split(",") if part.strip()]


# -- the parser, built from the tables below -----------------------------------------------------


@dataclass(frozen=True)
class Arg:
    """One `add_argument` call. `env` names a variable whose value, read when the parser is built
    (not at import, so a test or a shell can change it), replaces the default."""

    flags: tuple[str, ...]
    options: dict[str, Any]
    env: str | None = None

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        options = copy.deepcopy(self.options)  # each parser its own `default=[]`
        if self.env is not None:
            options["default"] = os.environ.get(self.env, options.get("default"))
        parser.add_argument(*self.flags, **options)


def arg(*flags: str, env: str | None = None, **options: Any) -> Arg:
    return Arg(flags, options, env)


@dataclass(frozen=True)
class Command:
    """A subcommand: its arguments in `--help` order, and either `run` or nested `subcommands`."""

    name: str
    help: str
    run: Callable[[argparse.Namespace], int] | None = None
    arguments: tuple[Arg, ...] = ()
    description: str | None = None
    subcommands: tuple[Command, ...] = ()
    subcommands_dest: str = "command"  # the Namespace attribute naming the chosen subcommand


REQUEST_ARGUMENTS = (
    arg("request", nargs="?", help="a System One request body (JSON file, or - for stdin)"),
    arg("--state", help="the state text"),
    arg("--state-file", help="read the state text from a file"),
    arg(
        "--question",
        action="append",
        default=[],
        metavar="SPEC",
        help="ID=TYPE:INSTRUCTIONS[:CRITERIA], repeatable: 'urgent=noul:Is it urgent?', "
        "'team=choice:Which team?:billing=Charges,engineering=Bugs', 'urgency=score:How urgent?:Low,Normal,High'",
    ),
    arg("--set", metavar="NAME", help="ask a saved question set (clef-flash sets list) about --state, instead of --question"),
    arg(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image (PNG, JPEG or WebP) in the state, repeatable up to 4; added to a request file's images too",
    ),
    arg(
        "--video",
        action="append",
        default=[],
        metavar="PATH",
        help="a video (MP4 or WebM) in the state, after the images, repeatable up to 4; sampled at 2 frames per "
        "second as the release's processor does; added to a request file's videos too",
    ),
)

TRUNCATE_STATE = arg(
    "--truncate-state",
    action="store_true",
    help="cut the state's end to fit the token limit, as the reference does (says how many tokens were cut); "
    "without it an over-long record is refused",
)

MODEL_ARGUMENTS = (
    arg(
        "--model",
        env="CLEF_FLASH_MODEL",
        default="tiny",
        help="release, 8-bit bundle or Core ML export directory, Hugging Face repo id (e.g. Cloudflare/clef-flash), "
        "'tiny' or random:NAME[:SEED] (random weights); default $CLEF_FLASH_MODEL or tiny",
    ),
    arg("--revision", help="hub revision (branch, tag or commit) for a repo id"),
)

ADAPTER = arg(
    "--adapter",
    action="append",
    metavar="[NAME=]DIR",
    help="a clef-finetune checkpoint (adapter/ + joint_head.safetensors) run beside the base: DIR answers as the "
    "fine-tune; NAME=DIR (repeat it for many) answers the requests whose 'adapter' field is NAME, the others get "
    "the base. eval labelled: the base and the tuned model side by side",
)

DEVICE_ARGUMENTS = (
    arg("--device", env="CLEF_FLASH_DEVICE", default="auto", help="auto, cpu or cuda"),
    arg(
        "--precision",
        env="CLEF_FLASH_PRECISION",
        choices=PRECISION_CHOICES,
        help="default: the fastest qualified path on this machine (see `clef-flash info`; model/precision.py)",
    ),
    arg("--verify", action="store_true", help="check a bundle's sha256 checksums before loading"),
    ADAPTER,
    arg(
        "--resident-layers",
        type=positive_int,
        metavar="N",
        help="low-memory mode: at most N decoder layers hold weights at once (e.g. 4 for an fp32 9B in 24 GB)",
    ),
    arg(
        "--state-cache-mb",
        type=non_negative_float,
        metavar="MB",
        help="keep the decoder state after each record's prefix + state, up to MB mebibytes, so that later "
        "questions about the same state skip it (default: 1/8 of this machine's memory, at most 4096; 0: off)",
    ),
    arg(
        "--segment-tokens",
        type=positive_int,
        metavar="N",
        help="run long records N tokens at a time, which bounds their memory (default 2048)",
    ),
    arg(
        "--coreml-runner",
        choices=RUNNERS,
        help="for a Core ML export: coreml (the default; macOS) or torch (its traced fp32 twins, rebuilt from the "
        "source it was exported from: checks an export anywhere before it goes to a Mac)",
    ),
)

RAY_ARGUMENTS = (
    arg("--ray", action="store_true", help='run on a Ray cluster (pip install "clef-flash[ray]")'),
    arg(
        "--address",
        help="the Ray cluster to join: HOST:6379 (`ray start --head` prints it), auto, or ray://HOST:10001; "
        "default $RAY_ADDRESS, else a new local cluster",
    ),
    arg(
        "--cpus-per-worker",
        type=positive_float,
        metavar="C",
        help="CPUs each Ray worker reserves, fractions allowed (batch default: an equal share of the cluster's "
        "CPUs less 0.5 for Ray Data's reads and the driver; serve default 1); its torch threads: C rounded, at least 1",
    ),
    arg("--gpus-per-worker", type=non_negative_float, metavar="G", help="GPUs each Ray worker reserves; > 0 runs it on cuda"),
)

EVALUATIONS = (
    Command(
        "agreement",
        "how far --model's answers are from --against-model's (the reference) on a JSONL file of requests",
        command_eval_agreement,
        (
            arg("requests", help="JSONL, one System One request per line"),
            *MODEL_ARGUMENTS,
            *DEVICE_ARGUMENTS,
            arg("--against-model", required=True, help="the reference model (a source as for --model)"),
            arg("--against-precision", help="the reference's precision (default bf16)"),
            arg("--against-revision", help="hub revision of --against-model"),
            arg(
                "--near-tie",
                type=float,
                default=0.05,
                help="a differing answer is a near-tie when the reference's top-2 margin is below this (default 0.05)",
            ),
            arg("--out", help="write report.json, report.md and agreement.png (|dp| distribution) into this directory"),
        ),
    ),
    Command(
        "labelled",
        "accuracy, macro-F1, log-loss, Brier, ECE and a reliability diagram on requests with expected answers",
        command_eval_labelled,
        (
            arg("file", help="JSONL of labelled requests"),
            *MODEL_ARGUMENTS,
            *DEVICE_ARGUMENTS,
            arg("--out", help="write report.json, report.md and reliability.png into this directory"),
        ),
        description='Each line is a System One request plus "expected": {question_id: label}: a choice label, '
        "true/false for noul, a level index or level text for score. Questions without a label are not scored.",
    ),
)

SETS = (
    Command(
        "add",
        "check a schema file and save it as a named question set",
        command_sets_add,
        (
            arg("name", help="1 to 64 letters, digits, - or _ (it names the MCP tool and the URL /v1/sets/NAME)"),
            arg("schema", help='a JSON file {"questions": {...}, "model"?: ..., "description"?: "what the MCP tool says it does"}'),
            arg("--replace", action="store_true", help="replace a saved set of that name"),
        ),
        description="The schema is checked as a request with those questions would be; an invalid one is "
        "refused with each problem's location, and nothing is saved.",
    ),
    Command("list", "the saved question sets and their questions", command_sets_list, (arg("--json", action="store_true", help="print the saved files as one JSON array"),)),
    Command("rm", "remove a saved question set", command_sets_rm, (arg("name"),)),
)

EXPORTS = (
    Command(
        "coreml",
        "the Core ML packages of the port (decoder parts, head, fp16 tables) from a release or an 8-bit bundle",
        command_export_coreml,
        (
            arg("source", help="release directory, 8-bit bundle, Hugging Face repo id, tiny or random:NAME"),
            arg("destination", help="the export directory to write"),
            arg(
                "--buckets",
                type=bucket_list,
                default=list(DEFAULT_BUCKETS),
                help=f"sequence lengths, one function each (default {','.join(map(str, DEFAULT_BUCKETS))})",
            ),
            arg("--head-questions", type=positive_int, default=HEAD_QUESTIONS, help=f"the head's questions (default {HEAD_QUESTIONS})"),
            arg("--head-options", type=positive_int, default=HEAD_OPTIONS, help=f"the head's options in all (default {HEAD_OPTIONS})"),
            arg("--overwrite", action="store_true", help="replace an existing destination"),
        ),
        description="Streams the source part by part (needs coremltools: pip install -e '.[coreml]'). Converting runs "
        "anywhere; running the packages needs macOS (clef-flash answer --model DESTINATION ...).",
    ),
)

COMMANDS = (
    Command(
        "info",
        "this machine: CPU features, torch build and threads, the probe's rates, the default precision and why",
        command_info,
        (
            arg("--json", action="store_true", help="print one JSON object"),
            arg("--reprobe", action="store_true", help="measure the rates again instead of reading the cached probe"),
            *MODEL_ARGUMENTS,
            ADAPTER,
        ),
    ),
    Command(
        "tiny",
        "write a random release with the real vocabulary (for smoke tests)",
        command_tiny,
        (
            arg("dir", help="output directory"),
            arg("--config", default="tiny", help="named random config: tiny, tiny-vision, 9b-heads, 9b-heads-outliers, 9b-part, 9b (default tiny)"),
            arg("--seed", type=int, default=0),
        ),
    ),
    Command(
        "answer",
        "answer a System One request",
        command_answer,
        (
            *REQUEST_ARGUMENTS,
            *MODEL_ARGUMENTS,
            *DEVICE_ARGUMENTS,
            arg("--json", action="store_true", help="print the System One response body"),
            arg("--table", action="store_true", help="print the readable table even when piped"),
            arg("--timings", action="store_true", help="add tokenize / decoder / head / total milliseconds"),
            arg("--max-length", type=positive_int, help="token limit per record (default 65536)"),
            TRUNCATE_STATE,
        ),
    ),
    Command(
        "render",
        "show the rendered prompt with question and option spans marked",
        command_render,
        (*REQUEST_ARGUMENTS, *MODEL_ARGUMENTS, arg("--max-length", type=int, help="token limit (default 65536)"), TRUNCATE_STATE),
    ),
    Command(
        "serve",
        "serve POST /v1/systemone (+ Workers AI route, /v1/models, /health, /metrics, a demo page at /)",
        command_serve,
        (
            *MODEL_ARGUMENTS,
            arg("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"),
            arg("--port", type=int, default=8000, help="default 8000"),
            *DEVICE_ARGUMENTS,
            arg(
                "--api-key",
                env="CLEF_FLASH_API_KEY",
                help="require 'Authorization: Bearer KEY' on the API routes (default $CLEF_FLASH_API_KEY; unset: no key)",
            ),
            arg("--max-body-bytes", type=int, default=1 << 20, help="request body limit, also after decompression (default 1 MiB)"),
            arg(
                "--max-image-body-bytes",
                type=int,
                default=12 << 20,
                help="the body limit for a request with images (default 12 MiB: 8 MiB of images as base64, and text)",
            ),
            arg(
                "--max-video-body-bytes",
                type=int,
                default=34 << 20,
                help="the body limit for a request with videos (default 34 MiB: 16 MiB of videos as base64, images and text)",
            ),
            arg("--max-length", type=int, help="token limit per record; longer ones get 422 (default 65536)"),
            arg("--batch-tokens", type=int, help="padded tokens per batch (default: the model's, 8192)"),
            arg("--batch-wait-ms", type=float, default=5.0, help="how long a request waits for others to batch with (default 5)"),
            arg("--max-batch", type=int, default=64, help="records per batch (default 64; 1 turns batching off)"),
            arg("--max-queue", type=int, default=256, help="queued records before 429 + Retry-After (default 256)"),
            arg(
                "--max-parsing-bytes",
                type=int,
                default=68 << 20,
                help="bytes of bodies being read, parsed and tokenized at once, before 429 + Retry-After; "
                "what bounds memory (default 68 MiB; at least twice --max-video-body-bytes)",
            ),
            arg("--request-timeout", type=float, default=300.0, metavar="S", help="the longest a request waits for the model, then 503 (default 300)"),
            arg("--header-timeout", type=float, default=10.0, metavar="S", help="a request's headers must arrive within this, else 408 and close (default 10)"),
            arg("--body-timeout", type=float, default=30.0, metavar="S", help="a request's body must arrive within this after its headers, else close (default 30)"),
            arg("--max-connections", type=positive_int, default=1024, help="open connections; one more gets 503 (default 1024)"),
            arg(
                "--shutdown-timeout",
                type=float,
                default=30.0,
                metavar="S",
                help="after SIGTERM, queued requests may finish for this long; then they get 503 and the process exits (default 30)",
            ),
            arg("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="default info"),
            *RAY_ARGUMENTS,
            arg("--replicas", type=positive_int, help="with --ray: engines behind Ray Serve's proxy (default 1)"),
        ),
    ),
    Command(
        "mcp",
        "the model as MCP tools for agents: decide, classify, and one per saved question set (stdio, or --http PORT)",
        command_mcp,
        (
            *MODEL_ARGUMENTS,
            *DEVICE_ARGUMENTS,
            arg("--http", type=positive_int, metavar="PORT", help="serve streamable HTTP at http://HOST:PORT/mcp instead of stdio"),
            arg("--host", default="127.0.0.1", help="with --http: the address to bind (default 127.0.0.1: this machine only)"),
            arg(
                "--api-key",
                env="CLEF_FLASH_API_KEY",
                help="with --http: require 'Authorization: Bearer KEY' (default $CLEF_FLASH_API_KEY; unset: no key)",
            ),
            arg("--max-length", type=positive_int, help="token limit per record; longer ones are a tool error (default 65536)"),
            arg("--batch-tokens", type=positive_int, help="padded tokens per batch (default: the model's, 8192)"),
            arg("--batch-wait-ms", type=non_negative_float, default=5.0, help="how long a call waits for others to batch with (default 5)"),
            arg("--max-batch", type=positive_int, default=64, help="records per batch (default 64)"),
            arg("--max-queue", type=positive_int, default=256, help="queued calls before a 'busy' tool error (default 256)"),
            arg("--request-timeout", type=positive_float, default=300.0, metavar="S", help="the longest a call waits for the model (default 300)"),
            arg("--log-level", default="warning", choices=["debug", "info", "warning", "error"], help="with --http: uvicorn's (default warning)"),
        ),
        description="Desktop agents launch it over stdio: command clef-flash, args [\"mcp\", \"--model\", \"SRC\"]. "
        "Each tool publishes its JSON schemas; a bad call is a tool error carrying the HTTP 422 body (message and location).",
    ),
    Command("sets", "saved question sets: add, list, rm", subcommands=SETS, subcommands_dest="action"),
    Command(
        "batch",
        "answer a JSONL file of requests (or of states, with --schema or --set) into JSONL; resumable",
        command_batch,
        (
            arg("input", help="JSONL input"),
            arg("output", help="JSONL output (appended to when resuming; OUTPUT.progress.json beside it)"),
            arg(
                "--schema",
                action="append",
                help='a JSON file {"questions": {...}, "model"?: ...} asked about every input state; repeat it to ask '
                'several (each output line then says which: "schema": its position from 0; each state runs once)',
            ),
            arg(
                "--set",
                dest="schema",
                action="append",
                type=SetName,
                metavar="NAME",
                help="a saved question set asked about every input state, as a --schema file is (they number together)",
            ),
            *MODEL_ARGUMENTS,
            *DEVICE_ARGUMENTS,
            arg("--batch-size", type=positive_int, default=32, help="input lines scored together and written at once (default 32)"),
            arg("--max-length", type=positive_int, help="token limit per record; longer ones get an error line (default 65536)"),
            arg("--overwrite", action="store_true", help="start over, replacing OUTPUT, instead of resuming"),
            *RAY_ARGUMENTS,
            arg("--workers", type=positive_int, help="with --ray: scoring actors, one engine each (default 1)"),
        ),
        description="Each input line is a System One request, or with --schema a state: a JSON object "
        '{"state": ..., "id": ...} or any other JSON value used as the state itself. Each output line is '
        '{"line", "id", ...the response body} or {"line", "id", "error": {"detail": [...]}}, in input order; '
        "id is the input's own (exactly) or its line number. Rerun the same command after a crash to resume. "
        "A .parquet input: each row is the JSON object of its columns. --ray: Ray Data reads the input on this "
        "machine, --workers actors score it (each loads --model itself), this process writes OUTPUT in order.",
    ),
    Command(
        "eval",
        "agreement between two models or precisions; accuracy on labelled requests",
        subcommands=EVALUATIONS,
        subcommands_dest="evaluation",
    ),
    Command(
        "bench",
        "latency percentiles, records/s, tokens/s and peak RSS of a model",
        command_bench,
        (
            *MODEL_ARGUMENTS,
            arg("--random", metavar="NAME", help="instead of --model: a random model built in memory (tiny, tiny-vision, 9b-heads, 9b-heads-outliers, 9b-part, 9b)"),
            arg("--seed", type=int, default=0, help="seed of --random's weights and of generated requests"),
            *DEVICE_ARGUMENTS,
            arg(
                "--batch-size",
                type=positive_ints,
                default=[1],
                help="records per forward, or several to compare: 1,2,4,8 (default 1)",
            ),
            arg("--plot", metavar="PNG", help="write latency and throughput by batch size as a PNG (needs matplotlib)"),
            arg("--requests", help="JSONL of requests to run (default: generated ones)"),
            arg("--records", type=positive_int, default=8, help="generated requests (default 8)"),
            arg(
                "--tokens",
                type=positive_int,
                default=512,
                help="tokens per generated request, about; the three questions alone take ~300 (default 512)",
            ),
            arg("--json", action="store_true", help="print the figures as one JSON object"),
        ),
    ),
    Command(
        "convert",
        "convert a release into an 8-bit bundle (memory-mapped, loads in seconds)",
        command_convert,
        (
            arg("source", help="release directory, Hugging Face repo id, or tiny"),
            arg("destination", help="the bundle directory to write"),
            arg("--precision", default="int8", choices=["int8"], help="weights' precision (int8)"),
            arg("--revision", help="hub revision for a repo id"),
            arg("--overwrite", action="store_true", help="replace an existing destination"),
        ),
    ),
    Command("export", "export for another runtime: coreml", subcommands=EXPORTS, subcommands_dest="format"),
)


def add_commands(parser: argparse.ArgumentParser, commands: Sequence[Command], dest: str) -> None:
    """A subparser per command, its arguments in table order; nested commands the same way."""
    choices = parser.add_subparsers(dest=dest, required=True, metavar=dest.upper())
    for command in commands:
        command_parser = choices.add_parser(command.name, help=command.help, description=command.description)
        for argument in command.arguments:
            argument.add_to(command_parser)
        if command.subcommands:
            add_commands(command_parser, command.subcommands, command.subcommands_dest)
        else:
            command_parser.set_defaults(run=command.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clef-flash",
        description="A fast, exact runtime for Cloudflare's clef-flash decision model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    add_commands(parser, COMMANDS, "command")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "ray", False) and getattr(args, "adapter", None):
        print("error: --adapter does not run on Ray yet (its workers load the base alone)", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except RequestInvalid as error:
        for item in error.errors:
            where = ".".join(str(part) for part in item["loc"])
            print(f"error: {where}: {item['msg']}", file=sys.stderr)
        return 2
    except (ClefError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
