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

from .console import format_answers, format_machine, format_timings
from .coreml import DEFAULT_BUCKETS, HEAD_OPTIONS, HEAD_QUESTIONS, RUNNERS
from .errors import ClefError, RequestInvalid
from .plan import PRECISION_CHOICES
from .request.records import DEFAULT_MAX_LENGTH
from .request.spec import decode_text, parse_question_spec
from .server.settings import ServerSettings

# -- reading a request ---------------------------------------------------------------------------


def read_file(path: str | Path, what: str) -> str:
    if not Path(path).is_file():
        raise ClefError(f"no {what} at {path}")
    return decode_text(Path(path).read_bytes(), str(path))


def read_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:  # not JSON, or an integer past Python's digit limit
        raise ClefError(f"{where} is not JSON: {exc}") from exc


def read_request(args: argparse.Namespace) -> Any:
    """The request body from --state/--question flags (or --set), a file, or stdin; --image and --video paths join
    its images and videos."""
    request = _read_request_body(args)
    for flag, field in (("image", "images"), ("video", "videos")):
        paths = getattr(args, flag, None) or []
        if paths and not isinstance(request, dict):
            raise ClefError(f"--{flag} needs a request object")
        for path in paths:
            if not Path(path).is_file():
                raise ClefError(f"no {flag} file at {path}")
        if paths:
            request = {**request, field: [*(request.get(field) or []), *map(Path, paths)]}
    return request


def _read_request_body(args: argparse.Namespace) -> Any:
    if args.state is not None or args.state_file is not None or args.question or args.set:
        if args.request:
            raise ClefError("give either a request file or --state/--question/--set flags, not both")
        if args.set and args.question:
            raise ClefError(f"--set {args.set} brings its own questions: drop --question, or drop --set")
        if args.state is None and args.state_file is None:
            raise ClefError(f"{'--set' if args.set else '--question'} needs a state: add --state TEXT or --state-file FILE")
        state = read_file(args.state_file, "state file") if args.state_file is not None else args.state
        if args.set:
            from .sets import SetStore

            return SetStore().get(args.set).request(state)
        if not args.question:
            raise ClefError("add at least one --question, e.g. --question 'urgent=noul:Is it urgent?'")
        return {"model": "clef-flash", "state": state, "questions": dict(map(parse_question_spec, args.question))}
    if args.request and args.request != "-":
        return read_json(read_file(args.request, "request file"), args.request)
    if sys.stdin.isatty():
        raise ClefError("no request: give a JSON file, pipe one on stdin, or use --state and --question")
    stream = getattr(sys.stdin, "buffer", None)  # bytes: the locale's decoding would hide the offset
    return read_json(decode_text(stream.read(), "stdin") if stream is not None else sys.stdin.read(), "stdin")


# -- the model options: one group, read by every command that loads a model -----------------------


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """`load`'s keywords from MODEL_OPTIONS' flags (each flag's dest is the keyword; --model is `source`; the
    --adapter values become `adapter=` and `adapters=`)."""
    from .loader import adapter_options

    options = {"source" if name == "model" else name: getattr(args, name) for name in MODEL_OPTION_NAMES if name != "adapter"}
    return {**options, **adapter_options(args.adapter)}


def load_model(args: argparse.Namespace, **options: Any):
    from .loader import load

    return load(**{**model_options(args), **options})


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
    """What each Ray worker loads: the model options and the plan resolved here, once, for the workers' device
    (cuda with --gpus-per-worker, else cpu); never weights."""
    from .distributed import EngineSpec

    device = "cuda" if args.gpus_per_worker else "cpu"
    if args.adapter:
        raise ClefError("--adapter does not run on Ray yet (its workers load the base alone): leave out --ray")
    if args.device not in ("auto", device):
        raise ClefError(f"on Ray the workers' device follows --gpus-per-worker ({device} here), not --device {args.device}")
    return EngineSpec.resolve(**{**model_options(args), "device": device, **options})


# -- commands ------------------------------------------------------------------------------------


def command_tiny(args: argparse.Namespace) -> int:
    from .checkpoint import write_random_release

    out = write_random_release(args.dir, args.config, seed=args.seed)
    print(f"wrote a random {args.config!r} release (seed {args.seed}) to {out}")
    return 0


def command_answer(args: argparse.Namespace) -> int:
    request = read_request(args)
    model = load_model(args, max_length=args.max_length)
    body = model.answer(request, truncate_state=args.truncate_state)
    if args.truncate_state:
        (record,) = model.last_records
        print(
            f"--truncate-state: cut {record.state_tokens_dropped} tokens from the state's end "
            f"(kept {record.state_tokens}; {record.token_count} of {model.max_length} in all)",
            file=sys.stderr,
        )
    timings = model.last_timings.as_dict()
    if args.json or (not sys.stdout.isatty() and not args.table):
        output = {**body, "timings": timings} if args.timings else body
        print(json.dumps(output, ensure_ascii=False, indent=None if not sys.stdout.isatty() else 2))
        return 0
    print(format_answers(body, random_weights=model.is_random))
    if args.timings:
        print(format_timings(timings))
    return 0


def command_render(args: argparse.Namespace) -> int:
    from .loader import open_encoder

    encoder = open_encoder(args.model, revision=args.revision, max_length=args.max_length)
    record = encoder.encode(read_request(args), truncate_state=args.truncate_state)
    print(encoder.marked_text(record))
    cut = f" ({record.state_tokens_dropped} cut from its end)" if args.truncate_state else ""
    media = record.media
    kinds = "" if media is None else " and ".join(kind for kind, count in (("images", media.image_count), ("videos", len(media.times))) if count)
    images = "" if media is None else f" ({kinds} {media.tokens})"
    print(
        f"\n--- tokens: prefix {record.prefix_tokens}{images}, state {record.state_tokens}{cut}, schema {record.schema_tokens}, "
        f"suffix {record.suffix_tokens}; total {record.token_count} of {encoder.max_length}",
        file=sys.stderr,
    )
    return 0


def served_settings(args: argparse.Namespace, command: str) -> dict[str, Any]:
    return ServerSettings.from_flags({name: getattr(args, name) for name in ServerSettings.flags(command)})


def command_serve(args: argparse.Namespace) -> int:
    check_ray_flags(args, "--address", "--replicas", "--cpus-per-worker", "--gpus-per-worker")
    settings = served_settings(args, "serve")
    if args.ray:
        from .distributed.ray_serve import serve_on_ray

        spec, replicas = engine_spec(args, max_length=args.max_length), args.replicas or 1
        where = f"{replicas} replica{'s' * (replicas > 1)} on Ray"
        print(f"serving {spec.source} ({spec.precision}, {where}) on http://{args.host}:{args.port}/", file=sys.stderr)
        cpus, gpus = args.cpus_per_worker or 1.0, args.gpus_per_worker or 0.0
        serve_on_ray(spec, settings, host=args.host, port=args.port, address=args.address, replicas=replicas, cpus_per_replica=cpus, gpus_per_replica=gpus)
        return 0
    from .server import serve

    model = load_model(args, max_length=args.max_length)
    meaning = ": the answers mean nothing" if model.is_random else ""
    print(f"serving {model!r} on http://{args.host}:{args.port}/{meaning}", file=sys.stderr)
    serve(model, host=args.host, port=args.port, log_level=args.log_level, **settings)
    return 0


def command_mcp(args: argparse.Namespace) -> int:
    import anyio

    from .server.mcp_tools import ToolServer
    from .server.transport import uvicorn_server

    settings = ServerSettings(**served_settings(args, "mcp"))
    model = load_model(args, max_length=args.max_length)
    tools = ToolServer(model, settings)
    about = f"{model!r}{': the answers mean nothing' if model.is_random else ''}; saved sets: {', '.join(tools.sets.names()) or 'none'}"
    if args.http is None:
        print(f"MCP over stdio: {about}", file=sys.stderr)
        anyio.run(tools.serve_stdio)
        return 0
    key = ", bearer key required" if settings.api_key else ""
    print(f"MCP on http://{args.host}:{args.http}/mcp{key}: {about}", file=sys.stderr)
    uvicorn_server(tools.http_app(host=args.host), host=args.host, port=args.http, log_level=args.log_level).run()
    return 0


def command_sets_add(args: argparse.Namespace) -> int:
    from .sets import SetStore

    schema = read_json(read_file(args.schema, "schema file"), args.schema)
    store = SetStore()
    try:
        saved = store.add(args.name, schema, replace=args.replace)
    except RequestInvalid:
        print(f"error: {args.schema} is not saved as set {args.name!r}:", file=sys.stderr)
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


class SetName(str):
    """A `batch --set NAME`, in the list of --schema files (the positions count both)."""


def schema_file(item: str) -> str:
    """A --schema file, or the file of a --set (checked first: a damaged set is refused by name)."""
    if not isinstance(item, SetName):
        return item
    from .sets import SetStore

    store = SetStore()
    store.get(item)
    return str(store.path(item))


def command_batch(args: argparse.Namespace) -> int:
    from .batch import BatchJob
    from .console import ProgressBar
    from .loader import resolve_plan

    check_ray_flags(args, "--address", "--workers", "--cpus-per-worker", "--gpus-per-worker")
    # The plan as resolved on this machine, not as asked: a job resumed on another kind of CPU, whose default
    # differs, is refused instead of mixing precisions in one output; what runs is that plan.
    if args.ray:
        spec = engine_spec(args, max_length=args.max_length)
        precision = spec.precision
    else:
        plan = resolve_plan(args.model, device=args.device, precision=args.precision, revision=args.revision, coreml_runner=args.coreml_runner)
        precision = plan.name
    made_with = {"source": args.model, "revision": args.revision, "precision": precision, "max_length": args.max_length}
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

        workers = {"workers": args.workers or 1, "cpus_per_worker": args.cpus_per_worker, "gpus_per_worker": args.gpus_per_worker or 0.0}
        summary = run_ray_batch(job, spec, batch_size=args.batch_size, address=args.address, progress=progress, **workers)
    else:
        summary = job.run(load_model(args, max_length=args.max_length, plan=plan), batch_size=args.batch_size, progress=progress)
    print(f"wrote {summary.written} lines ({summary.errors} errors) to {args.output} in {summary.seconds:.1f} s", file=sys.stderr)
    return 0


def write_report(args: argparse.Namespace, report: dict[str, Any], markdown: str, figure: tuple[str, Callable[[], Any]]) -> None:
    """The Markdown report on stdout; with --out, report.json, report.md and the figure (file name, a function
    drawing it) in that directory."""
    from . import plots
    from .evaluate import write_reports

    print(markdown, end="")
    if args.out:
        name, draw = figure
        written = write_reports(args.out, report, markdown, {name: plots.png(draw())})
        print(f"wrote {', '.join(str(path) for path in written)}", file=sys.stderr)


def command_eval_agreement(args: argparse.Namespace) -> int:
    from .evaluate import agreement_markdown, evaluate_agreement
    from .loader import load
    from .plots import agreement_figure

    against = {"device": args.device, "precision": args.against_precision, "revision": args.against_revision}
    report = evaluate_agreement(args.requests, lambda: load_model(args), lambda: load(args.against_model, **against), near_tie=args.near_tie)
    write_report(args, report, agreement_markdown(report), ("agreement.png", lambda: agreement_figure(report)))
    return 0


def command_eval_labelled(args: argparse.Namespace) -> int:
    from .evaluate import evaluate_labelled, labelled_markdown
    from .plots import reliability_figure

    if args.adapter:  # the base and the tuned model side by side, from one copy of the base
        from .evaluate import base_vs_tuned_markdown, evaluate_base_vs_tuned
        from .loader import side_by_side

        name, adapters = side_by_side(args.adapter)
        args.adapter = None
        report = evaluate_base_vs_tuned(args.file, load_model(args, adapters=adapters), name)
        write_report(args, report, base_vs_tuned_markdown(report), ("reliability.png", lambda: reliability_figure(report["tuned"]["reliability"])))
        return 0
    report = evaluate_labelled(args.file, lambda: load_model(args))
    write_report(args, report, labelled_markdown(report), ("reliability.png", lambda: reliability_figure(report["reliability"])))
    return 0


def command_info(args: argparse.Namespace) -> int:
    from .machine import report

    measured = report(reprobe=args.reprobe)
    if args.adapter:  # checked against --model's config, the base not built
        from .loader import describe_adapters

        measured["adapters"] = describe_adapters(args.model, args.adapter, revision=args.revision)
    print(json.dumps(measured, indent=2) if args.json else format_machine(measured))
    return 0


def command_bench(args: argparse.Namespace) -> int:
    from .batch import read_jsonl
    from .bench import bench, format_bench, generated_requests

    requests = [request for _, request in read_jsonl(args.requests)] if args.requests else None
    random_source = f"random:{args.random}" + (f":{args.seed}" if args.seed else "")
    model = load_model(args, **({"source": random_source} if args.random else {}))
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


def command_convert(args: argparse.Namespace) -> int:
    from .conversion import convert

    start = time.perf_counter()
    out = convert(args.source, args.destination, revision=args.revision, overwrite=args.overwrite, verify=True)
    size = sum(path.stat().st_size for path in out.iterdir())
    print(f"wrote an {args.precision} bundle to {out} ({size / 1e9:.2f} GB, {time.perf_counter() - start:.1f} s, checksums verified)")
    return 0


def command_export_coreml(args: argparse.Namespace) -> int:
    from .coreml.export import export_coreml

    shape = {"buckets": args.buckets, "head_questions": args.head_questions, "head_options": args.head_options}
    log = lambda message: print(message, file=sys.stderr)  # noqa: E731
    report = export_coreml(args.source, args.destination, **shape, overwrite=args.overwrite, log=log)
    sizes = ", ".join(f"{name} {size / 1e6:,.1f} MB" for name, size in report["files"].items())
    print(
        f"wrote the Core ML packages to {args.destination} ({sizes}; {report['seconds']['total']:.1f} s, "
        f"peak RSS {report['peak_rss_mb']:,} MB). Run them on a Mac: clef-flash answer --model {args.destination} ..."
    )
    return 0


# -- the parser, built from the tables below -----------------------------------------------------


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


def bucket_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"buckets are comma-separated token counts, e.g. 256,512,1024; got {text!r}") from None


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

    @property
    def dest(self) -> str:
        return self.options.get("dest") or self.flags[0].lstrip("-").replace("-", "_")


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


# A setting's type and bound -> its one validator (server/settings.py `Flag`).
SETTING_TYPES = {("int", False): positive_int, ("float", False): positive_float, ("float", True): non_negative_float, ("str", False): str}


def settings_flags(command: str) -> tuple[Arg, ...]:
    """`serve`'s or `mcp`'s flags, one per `ServerSettings` field that has a `Flag`: its default is the field's."""
    defaults = ServerSettings()
    flags = []
    for name, (flag, kind) in ServerSettings.flags(command).items():
        help = flag.mcp if command == "mcp" and isinstance(flag.mcp, str) else flag.help
        options = {"metavar": "S"} if name.endswith("_s") else {}
        validator = SETTING_TYPES[kind, flag.zero_allowed]
        option = "--" + name.removesuffix("_s").replace("_", "-")
        flags.append(arg(option, dest=name, env=flag.env, type=validator, default=getattr(defaults, name), help=help, **options))
    return tuple(flags)


REQUEST_ARGUMENTS = (
    arg("request", nargs="?", help="a System One request body (JSON file, or - for stdin)"),
    arg("--state", help="the state text"),
    arg("--state-file", help="read the state text from a file"),
    arg("--question", action="append", default=[], metavar="SPEC", help="ID=TYPE:INSTRUCTIONS[:CRITERIA], repeatable: "
        "'urgent=noul:Is it urgent?', 'team=choice:Which team?:billing=Charges,engineering=Bugs', 'urgency=score:How urgent?:Low,Normal,High'"),
    arg("--set", metavar="NAME", help="ask a saved question set (clef-flash sets list) about --state, instead of --question"),
    arg("--image", action="append", default=[], metavar="PATH",
        help="an image (PNG, JPEG or WebP) in the state, repeatable up to 4; added to a request file's images too"),
    arg("--video", action="append", default=[], metavar="PATH", help="a video (MP4 or WebM) in the state, after the images, "
        "repeatable up to 4; sampled at 2 frames per second as the release's processor does; added to a request file's videos too"),
)
TRUNCATE_STATE = arg("--truncate-state", action="store_true", help="cut the state's end to fit the token limit, as the reference "
                     "does (says how many tokens were cut); without it an over-long record is refused")
SOURCE = (
    arg("--model", env="CLEF_FLASH_MODEL", default="tiny", help="release, 8-bit bundle or Core ML export directory, Hugging Face "
        "repo id (e.g. Cloudflare/clef-flash), 'tiny' or random:NAME[:SEED] (random weights); default $CLEF_FLASH_MODEL or tiny"),
    arg("--revision", help="hub revision (branch, tag or commit) for a repo id"),
)
# What every command that loads a model takes, in one place: each flag's dest is a keyword of `clef_flash.load`
# (`model_options`; --model is `source`), so a new load option is one line here.
MODEL_OPTIONS = (
    *SOURCE,
    arg("--device", env="CLEF_FLASH_DEVICE", default="auto", help="auto, cpu or cuda"),
    arg("--precision", env="CLEF_FLASH_PRECISION", choices=PRECISION_CHOICES,
        help="default: the fastest qualified path on this machine (see `clef-flash info`; model/precision.py)"),
    arg("--verify", action="store_true", help="check a bundle's sha256 checksums before loading"),
    arg("--resident-layers", type=positive_int, metavar="N",
        help="low-memory mode: at most N decoder layers hold weights at once (e.g. 4 for an fp32 9B in 24 GB)"),
    arg("--state-cache-mb", type=non_negative_float, metavar="MB", help="keep the decoder state after each record's prefix + "
        "state, up to MB mebibytes, so that later questions about the same state skip it (default: 1/8 of this machine's memory, "
        "at most 4096; 0: off)"),
    arg("--segment-tokens", type=positive_int, metavar="N", help="run long records N tokens at a time, which bounds their memory (default 2048)"),
    arg("--coreml-runner", choices=RUNNERS, help="for a Core ML export: coreml (the default; macOS) or torch (its traced fp32 twins, "
        "rebuilt from the source it was exported from: checks an export anywhere before it goes to a Mac)"),
    ADAPTER := arg("--adapter", action="append", metavar="[NAME=]DIR", help="a clef-finetune checkpoint (adapter/ + "
        "joint_head.safetensors) run beside the base: DIR answers as the fine-tune; NAME=DIR (repeat it for many) answers the "
        "requests whose 'adapter' field is NAME, the others get the base. eval labelled: the base and the tuned model side by side"),
)
MODEL_OPTION_NAMES = tuple(option.dest for option in MODEL_OPTIONS)


def max_length(what: str) -> Arg:
    return arg("--max-length", type=positive_int, help=f"token limit per record{what} (default {DEFAULT_MAX_LENGTH})")


RAY_ARGUMENTS = (
    arg("--ray", action="store_true", help='run on a Ray cluster (pip install "clef-flash[ray]")'),
    arg("--address", help="the Ray cluster to join: HOST:6379 (`ray start --head` prints it), auto, or ray://HOST:10001; "
        "default $RAY_ADDRESS, else a new local cluster"),
    arg("--cpus-per-worker", type=positive_float, metavar="C", help="CPUs each Ray worker reserves, fractions allowed (batch "
        "default: an equal share of the cluster's CPUs less 0.5 for Ray Data's reads and the driver; serve default 1); its torch "
        "threads: C rounded, at least 1"),
    arg("--gpus-per-worker", type=non_negative_float, metavar="G", help="GPUs each Ray worker reserves; > 0 runs it on cuda"),
)
LOG_LEVELS = ["debug", "info", "warning", "error"]
RANDOM_NAMES = "tiny, tiny-vision, 9b-heads, 9b-heads-outliers, 9b-part, 9b, 27b-part, 27b"  # checkpoint.RANDOM_CONFIGS (test_cli holds them)
OVERWRITE = arg("--overwrite", action="store_true", help="replace an existing destination")

EVALUATIONS = (
    Command("agreement", "how far --model's answers are from --against-model's (the reference) on a JSONL file of requests",
            command_eval_agreement, (
        arg("requests", help="JSONL, one System One request per line"),
        *MODEL_OPTIONS,
        arg("--against-model", required=True, help="the reference model (a source as for --model)"),
        arg("--against-precision", help="the reference's precision (default bf16)"),
        arg("--against-revision", help="hub revision of --against-model"),
        arg("--near-tie", type=float, default=0.05,
            help="a differing answer is a near-tie when the reference's top-2 margin is below this (default 0.05)"),
        arg("--out", help="write report.json, report.md and agreement.png (|dp| distribution) into this directory"),
    )),
    Command("labelled", "accuracy, macro-F1, log-loss, Brier, ECE and a reliability diagram on requests with expected answers",
            command_eval_labelled, (
        arg("file", help="JSONL of labelled requests"),
        *MODEL_OPTIONS,
        arg("--out", help="write report.json, report.md and reliability.png into this directory"),
    ), description='Each line is a System One request plus "expected": {question_id: label}: a choice label, true/false for '
            "noul, a level index or level text for score. Questions without a label are not scored."),
)
SETS = (
    Command("add", "check a schema file and save it as a named question set", command_sets_add, (
        arg("name", help="1 to 64 letters, digits, - or _ (it names the MCP tool and the URL /v1/sets/NAME)"),
        arg("schema", help='a JSON file {"questions": {...}, "model"?: ..., "description"?: "what the MCP tool says it does"}'),
        arg("--replace", action="store_true", help="replace a saved set of that name"),
    ), description="The schema is checked as a request with those questions would be; an invalid one is refused with each "
            "problem's location, and nothing is saved."),
    Command("list", "the saved question sets and their questions", command_sets_list,
            (arg("--json", action="store_true", help="print the saved files as one JSON array"),)),
    Command("rm", "remove a saved question set", command_sets_rm, (arg("name"),)),
)
EXPORTS = (
    Command("coreml", "the Core ML packages of the port (decoder parts, head, fp16 tables) from a release or an 8-bit bundle",
            command_export_coreml, (
        arg("source", help="release directory, 8-bit bundle, Hugging Face repo id, tiny or random:NAME"),
        arg("destination", help="the export directory to write"),
        arg("--buckets", type=bucket_list, default=list(DEFAULT_BUCKETS),
            help=f"sequence lengths, one function each (default {','.join(map(str, DEFAULT_BUCKETS))})"),
        arg("--head-questions", type=positive_int, default=HEAD_QUESTIONS, help=f"the head's questions (default {HEAD_QUESTIONS})"),
        arg("--head-options", type=positive_int, default=HEAD_OPTIONS, help=f"the head's options in all (default {HEAD_OPTIONS})"),
        OVERWRITE,
    ), description="Streams the source part by part (needs coremltools: pip install -e '.[coreml]'). Converting runs anywhere; "
            "running the packages needs macOS (clef-flash answer --model DESTINATION ...)."),
)
COMMANDS = (
    Command("info", "this machine: CPU features, torch build and threads, the probe's rates, the default precision and why",
            command_info, (arg("--json", action="store_true", help="print one JSON object"), arg("--reprobe", action="store_true", help="measure the rates again instead of reading the cached probe"),
                           *SOURCE, ADAPTER)),
    Command("tiny", "write a random release with the real vocabulary (for smoke tests)", command_tiny, (
        arg("dir", help="output directory"),
        arg("--config", default="tiny", help=f"named random config: {RANDOM_NAMES} (default tiny)"),
        arg("--seed", type=int, default=0),
    )),
    Command("answer", "answer a System One request", command_answer, (
        *REQUEST_ARGUMENTS,
        *MODEL_OPTIONS,
        arg("--json", action="store_true", help="print the System One response body"),
        arg("--table", action="store_true", help="print the readable table even when piped"),
        arg("--timings", action="store_true", help="add tokenize / decoder / head / total milliseconds"),
        max_length(""),
        TRUNCATE_STATE,
    )),
    Command("render", "show the rendered prompt with question and option spans marked", command_render,
            (*REQUEST_ARGUMENTS, *SOURCE, max_length(""), TRUNCATE_STATE)),
    Command("serve", "serve POST /v1/systemone (+ Workers AI route, /v1/models, /health, /metrics, a demo page at /)", command_serve, (
        *MODEL_OPTIONS,
        arg("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"),
        arg("--port", type=int, default=8000, help="default 8000"),
        max_length("; longer ones get 422"),
        *settings_flags("serve"),
        arg("--log-level", default="info", choices=LOG_LEVELS, help="default info"),
        *RAY_ARGUMENTS,
        arg("--replicas", type=positive_int, help="with --ray: engines behind Ray Serve's proxy (default 1)"),
    )),
    Command("mcp", "the model as MCP tools for agents: decide, classify, and one per saved question set (stdio, or --http PORT)",
            command_mcp, (
        *MODEL_OPTIONS,
        arg("--http", type=positive_int, metavar="PORT", help="serve streamable HTTP at http://HOST:PORT/mcp instead of stdio"),
        arg("--host", default="127.0.0.1", help="with --http: the address to bind (default 127.0.0.1: this machine only)"),
        max_length("; longer ones are a tool error"),
        *settings_flags("mcp"),
        arg("--log-level", default="warning", choices=LOG_LEVELS, help="with --http: uvicorn's (default warning)"),
    ), description='Desktop agents launch it over stdio: command clef-flash, args ["mcp", "--model", "SRC"]. Each tool publishes '
            "its JSON schemas; a bad call is a tool error carrying the HTTP 422 body (message and location)."),
    Command("sets", "saved question sets: add, list, rm", subcommands=SETS, subcommands_dest="action"),
    Command("batch", "answer a JSONL file of requests (or of states, with --schema or --set) into JSONL; resumable", command_batch, (
        arg("input", help="JSONL input"),
        arg("output", help="JSONL output (appended to when resuming; OUTPUT.progress.json beside it)"),
        arg("--schema", action="append", help='a JSON file {"questions": {...}, "model"?: ...} asked about every input state; repeat '
            'it to ask several (each output line then says which: "schema": its position from 0; each state runs once)'),
        arg("--set", dest="schema", action="append", type=SetName, metavar="NAME",
            help="a saved question set asked about every input state, as a --schema file is (they number together)"),
        *MODEL_OPTIONS,
        arg("--batch-size", type=positive_int, default=32, help="input lines scored together and written at once (default 32)"),
        max_length("; longer ones get an error line"),
        arg("--overwrite", action="store_true", help="start over, replacing OUTPUT, instead of resuming"),
        *RAY_ARGUMENTS,
        arg("--workers", type=positive_int, help="with --ray: scoring actors, one engine each (default 1)"),
    ), description='Each input line is a System One request, or with --schema a state: a JSON object {"state": ..., "id": ...} '
            'or any other JSON value used as the state itself. Each output line is {"line", "id", ...the response body} or '
            '{"line", "id", "error": {"detail": [...]}}, in input order; id is the input\'s own (exactly) or its line number. '
            "Rerun the same command after a crash to resume. A .parquet input: each row is the JSON object of its columns. "
            "--ray: Ray Data reads the input on this machine, --workers actors score it (each loads --model itself), this "
            "process writes OUTPUT in order."),
    Command("eval", "agreement between two models or precisions; accuracy on labelled requests", subcommands=EVALUATIONS,
            subcommands_dest="evaluation"),
    Command("bench", "latency percentiles, records/s, tokens/s and peak RSS of a model", command_bench, (
        *MODEL_OPTIONS,
        arg("--random", metavar="NAME", help=f"instead of --model: a random model built in memory ({RANDOM_NAMES})"),
        arg("--seed", type=int, default=0, help="seed of --random's weights and of generated requests"),
        arg("--batch-size", type=positive_ints, default=[1], help="records per forward, or several to compare: 1,2,4,8 (default 1)"),
        arg("--plot", metavar="PNG", help="write latency and throughput by batch size as a PNG (needs matplotlib)"),
        arg("--requests", help="JSONL of requests to run (default: generated ones)"),
        arg("--records", type=positive_int, default=8, help="generated requests (default 8)"),
        arg("--tokens", type=positive_int, default=512,
            help="tokens per generated request, about; the three questions alone take ~300 (default 512)"),
        arg("--json", action="store_true", help="print the figures as one JSON object"),
    )),
    Command("convert", "convert a release into an 8-bit bundle (memory-mapped, loads in seconds)", command_convert, (
        arg("source", help="release directory, Hugging Face repo id, or tiny"),
        arg("destination", help="the bundle directory to write"),
        arg("--precision", default="int8", choices=["int8"], help="weights' precision (int8)"),
        arg("--revision", help="hub revision for a repo id"),
        OVERWRITE,
    )),
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
