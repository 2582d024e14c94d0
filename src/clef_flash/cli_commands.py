"""The command line's commands: each reads its arguments, calls the public API (`clef_flash.load`, `Clef`, batch,
eval, the servers) and prints; nothing here computes what the API computes (tests/test_architecture.py). The
grammar they are called from is cli.py's table; the options they read, cli_options.py's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .console import format_answers, format_explanation, format_machine, format_timings
from .errors import ClefError, RequestInvalid
from .request.spec import decode_text, parse_question_spec
from .server.settings import ServerSettings
from .cli_options import MODEL_OPTION_NAMES


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


def command_explain(args: argparse.Namespace) -> int:
    request = read_request(args)
    model = load_model(args, max_length=args.max_length)
    body = model.explain(request, **{name: getattr(args, name) for name in ("method", "depth", "max_parts", "steps", "question_ids")}).to_dict()
    print(json.dumps(body, ensure_ascii=False) if args.json else format_explanation(body, random_weights=model.is_random))
    if args.plot:
        from .plots import explanation_figure, png

        Path(args.plot).write_bytes(png(explanation_figure(body)))
        print(f"wrote {args.plot}", file=sys.stderr)
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
    """The server settings of `command`'s flags, their combination checked before any model loads: an error names
    the flags (`--max-parsing-bytes`), not the settings' fields."""
    flags = ServerSettings.flags(command)
    settings = ServerSettings.from_flags({name: getattr(args, name) for name in flags})
    try:
        ServerSettings(**settings)
    except ValueError as error:
        message = str(error)
        for name in sorted(flags, key=len, reverse=True):  # max_video_body_bytes before max_body_bytes
            message = re.sub(rf"\b{name}\b", "--" + name.replace("_", "-"), message)
        raise ClefError(message) from None
    return settings


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
    if args.calibration:  # (only then: a job started before calibrations existed resumes)
        from .calibration import read_calibration

        made_with["calibration"] = read_calibration(args.calibration).digest[:16]
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

    if args.fit_calibration:
        return command_fit_calibration(args)
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


def command_fit_calibration(args: argparse.Namespace) -> int:
    """eval labelled --fit-calibration: every --adapter kept apart beside the base, each fitted on every line."""
    from .evaluate import calibration_markdown, fit_calibration
    from .loader import adapter_options, named_paths
    from .plots import calibration_figure

    if args.calibration:
        raise ClefError("--fit-calibration fits on the model's own probabilities: leave out --calibration")
    named, args.adapter = named_paths(adapter_options(args.adapter)), None
    model = load_model(args, adapters=named or None)
    calibration, report = fit_calibration(
        args.file, model, adapters=[None, *named] if named else None, holdout=args.holdout, seed=args.seed, min_examples=args.min_examples
    )
    calibration.save(args.fit_calibration)
    write_report(args, report, calibration_markdown(report), ("reliability.png", lambda: calibration_figure(report)))
    print(f"wrote the calibration to {args.fit_calibration} (sha256 {calibration.digest[:16]}): answer with --calibration {args.fit_calibration}", file=sys.stderr)
    return 0


def command_info(args: argparse.Namespace) -> int:
    from .machine import report

    measured = report(reprobe=args.reprobe)
    if args.adapter:  # checked against --model's config, the base not built
        from .loader import describe_adapters

        measured["adapters"] = describe_adapters(args.model, args.adapter, revision=args.revision)
    if args.calibration:  # checked against --model's config, no weights loaded
        from .loader import describe_calibration

        measured["calibration"] = describe_calibration(args.model, args.calibration, revision=args.revision)
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


