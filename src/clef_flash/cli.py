"""The `clef-flash` command: a thin layer over the Python API.

    clef-flash tiny DIR                       write a random release (real vocabulary) for smoke tests
    clef-flash answer --model SRC [REQUEST]   answer a System One request (file, stdin, or flags)
    clef-flash explain --model SRC [REQUEST]  why: each part of the state's contribution to every option (--json, --plot)
    clef-flash render [REQUEST]               show the rendered prompt, spans and token counts
    clef-flash serve --model SRC              a System One HTTP server, with a triage demo page at /; --ray: Ray Serve
    clef-flash mcp --model SRC                the model as MCP tools (decide, classify, explain, one per set): stdio, or --http PORT
    clef-flash sets add|list|rm               saved question sets: answer --set, POST /v1/sets/NAME, batch --set, MCP
    clef-flash batch IN OUT --model SRC       JSONL requests (or states + --schema) to JSONL answers; resumable;
                                              --ray: on a Ray cluster (Ray Data), the same output
    clef-flash eval agreement REQUESTS        --model A vs --against-model B: answers that differ, |dp|, near-ties
    clef-flash eval labelled FILE --model SRC accuracy, macro-F1, log-loss, Brier, ECE, a reliability diagram;
                                              --fit-calibration OUT: a temperature per question, for --calibration OUT
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
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Sequence

from .coreml import DEFAULT_BUCKETS, HEAD_OPTIONS, HEAD_QUESTIONS
from .errors import ClefError, RequestInvalid
from .evaluate import DEFAULT_HOLDOUT, DEFAULT_MIN_EXAMPLES
from .explain import DEFAULT_MAX_PARTS, DEFAULT_STEPS, METHODS, MOST_PARTS
from .cli_commands import (
    SetName,
    command_answer,
    command_batch,
    command_bench,
    command_convert,
    command_eval_agreement,
    command_eval_labelled,
    command_explain,
    command_export_coreml,
    command_info,
    command_mcp,
    command_render,
    command_serve,
    command_sets_add,
    command_sets_list,
    command_sets_rm,
    command_tiny,
)
from .cli_options import (
    ADAPTER,
    CALIBRATION,
    LOG_LEVELS,
    MODEL_OPTIONS,
    OVERWRITE,
    RANDOM_NAMES,
    RAY_ARGUMENTS,
    REQUEST_ARGUMENTS,
    SOURCE,
    TRUNCATE_STATE,
    Arg,
    arg,
    bucket_list,
    fraction,
    max_length,
    positive_int,
    positive_ints,
    settings_flags,
)


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
        arg("--fit-calibration", metavar="OUT", help="fit a temperature per question (and per --adapter, beside the base) on the "
            "file less a held-out share, write them to OUT (JSON; answer with --calibration OUT) and report the held-out "
            "accuracy, log-loss, Brier and ECE before and after"),
        arg("--holdout", type=fraction, default=DEFAULT_HOLDOUT,
            help=f"with --fit-calibration: the share of records held out (default {DEFAULT_HOLDOUT})"),
        arg("--seed", type=int, default=0, help="with --fit-calibration: the seed of the held-out draw (default 0)"),
        arg("--min-examples", type=positive_int, default=DEFAULT_MIN_EXAMPLES, metavar="N", help="with --fit-calibration: a "
            f"question with fewer labelled answers in the fitting part keeps T = 1 (default {DEFAULT_MIN_EXAMPLES})"),
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
                           *SOURCE, ADAPTER, CALIBRATION)),
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
    Command("explain", "why it decided that: each part of the state's contribution to every option of every question", command_explain, (
        *REQUEST_ARGUMENTS,
        *MODEL_OPTIONS,
        arg("--method", choices=METHODS, default=METHODS[0], help="leave-out (default): how much each probability drops when the "
            "part is left out; integrated-gradients, input-x-gradient: token attributions (Captum; fp32 or bf16 models)"),
        arg("--depth", type=positive_int, default=1, help="how deep a JSON state splits into parts (default 1: its top-level fields)"),
        arg("--max-parts", type=positive_int, default=DEFAULT_MAX_PARTS,
            help=f"refuse a state of more parts (default {DEFAULT_MAX_PARTS}, at most {MOST_PARTS}; each part costs a partial record)"),
        arg("--steps", type=positive_int, default=DEFAULT_STEPS, help=f"integrated-gradients: steps along the path (default {DEFAULT_STEPS})"),
        arg("--question-id", dest="question_ids", action="append", metavar="ID", help="explain only this question (repeatable; default all)"),
        arg("--json", action="store_true", help="print the explanation as one JSON object"),
        arg("--plot", metavar="PNG", help="write a bar chart per question (each part's contribution to its decision) as a PNG"),
        max_length(""),
    ), description="Parts: each image and video, each field of a JSON state (to --depth levels), each sentence or line of a "
            "text. leave-out answers the request once more per part, without it (the shared start of the record runs once). "
            "A state of one part or none, more parts than --max-parts or an unknown --question-id is refused in one line."),
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
    Command("mcp", "the model as MCP tools for agents: decide, classify, explain, and one per saved question set (stdio, or --http PORT)",
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
        arg("source", help="release directory, Hugging Face repo id, tiny, or random:NAME[:SEED] (drawn as converted)"),
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
