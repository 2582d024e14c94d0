"""The `clef-flash` command: a thin layer over the Python API.

    clef-flash tiny DIR                       write a random release (real vocabulary) for smoke tests
    clef-flash answer --model SRC [REQUEST]   answer a System One request (file, stdin, or flags)
    clef-flash render [REQUEST]               show the rendered prompt, spans and token counts

Environment defaults: CLEF_FLASH_MODEL (--model), CLEF_FLASH_DEVICE (--device),
CLEF_FLASH_PRECISION (--precision).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from .errors import ClefError, RequestInvalid

BAR_WIDTH = 24


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


def read_request(args: argparse.Namespace) -> Any:
    """The request body from --state/--question flags, a file, or stdin."""
    if args.state is not None or args.state_file is not None or args.question:
        if args.request:
            raise ClefError("give either a request file or --state/--question flags, not both")
        if args.state_file is not None:
            state: Any = Path(args.state_file).read_text()
        elif args.state is not None:
            state = args.state
        else:
            raise ClefError("--question needs a state: add --state TEXT or --state-file FILE")
        if not args.question:
            raise ClefError("add at least one --question, e.g. --question 'urgent=noul:Is it urgent?'")
        questions = dict(parse_question_spec(spec) for spec in args.question)
        return {"model": "clef-flash", "state": state, "questions": questions}
    if args.request and args.request != "-":
        path = Path(args.request)
        if not path.is_file():
            raise ClefError(f"no request file at {path}")
        text, where = path.read_text(), str(path)
    else:
        if sys.stdin.isatty():
            raise ClefError("no request: give a JSON file, pipe one on stdin, or use --state and --question")
        text, where = sys.stdin.read(), "stdin"
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClefError(f"{where} is not JSON: {exc}") from exc


# -- output --------------------------------------------------------------------------------------


def bar(probability: float) -> str:
    filled = round(probability * BAR_WIDTH)
    return "█" * filled + "·" * (BAR_WIDTH - filled)


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
    from .testing import write_random_release

    out = write_random_release(args.dir, args.config, seed=args.seed)
    print(f"wrote a random {args.config!r} release (seed {args.seed}) to {out}")
    return 0


def command_answer(args: argparse.Namespace) -> int:
    from .engine import load

    request = read_request(args)
    model = load(args.model, device=args.device, precision=args.precision, revision=args.revision)
    body = model.answer(request)
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


def command_render(args: argparse.Namespace) -> int:
    from .records import DEFAULT_MAX_LENGTH, encode_record
    from .protocol import parse_request
    from .tokenizer import Tokenizer
    from .weights import resolve_source

    request = parse_request(read_request(args))
    tokenizer = Tokenizer.from_file(resolve_source(args.model, revision=args.revision) / "tokenizer.json")
    record = encode_record(tokenizer, request, max_length=args.max_length or DEFAULT_MAX_LENGTH)
    ids = record.input_ids
    marks: dict[int, list[str]] = {}
    for question in record.questions:
        start, end = question.question_span
        marks.setdefault(start, []).append(f"⟦Q {question.question_id}:")
        marks.setdefault(end, []).insert(0, "⟧")
        for option_id, (start, end) in zip(question.option_ids, question.option_spans):
            marks.setdefault(start, []).append(f"⟦O {option_id}:")
            marks.setdefault(end, []).insert(0, "⟧")
    pieces, cursor = [], 0
    for position in sorted(marks):
        pieces.append(tokenizer.decode(ids[cursor:position]))
        pieces.append("".join(marks[position]))
        cursor = position
    pieces.append(tokenizer.decode(ids[cursor:]))
    print("".join(pieces))
    limit = args.max_length or DEFAULT_MAX_LENGTH
    print(
        f"\n--- tokens: prefix {record.prefix_tokens}, state {record.state_tokens}, schema {record.schema_tokens}, "
        f"suffix {record.suffix_tokens}; total {record.token_count} of {limit}",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clef-flash",
        description="A fast, exact runtime for Cloudflare's clef-flash decision model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tiny = sub.add_parser("tiny", help="write a random release with the real vocabulary (for smoke tests)")
    tiny.add_argument("dir", help="output directory")
    tiny.add_argument("--config", default="tiny", help="named random config: tiny, 9b-heads, 9b-part, 9b (default tiny)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=command_tiny)

    def add_request_arguments(command: argparse.ArgumentParser) -> None:
        command.add_argument("request", nargs="?", help="a System One request body (JSON file, or - for stdin)")
        command.add_argument("--state", help="the state text")
        command.add_argument("--state-file", help="read the state text from a file")
        command.add_argument(
            "--question",
            action="append",
            default=[],
            metavar="SPEC",
            help="ID=TYPE:INSTRUCTIONS[:CRITERIA], repeatable: 'urgent=noul:Is it urgent?', "
            "'team=choice:Which team?:billing=Charges,engineering=Bugs', 'urgency=score:How urgent?:Low,Normal,High'",
        )

    def add_model_arguments(command: argparse.ArgumentParser) -> None:
        command.add_argument(
            "--model",
            default=os.environ.get("CLEF_FLASH_MODEL", "tiny"),
            help="release directory, Hugging Face repo id (e.g. Cloudflare/clef-flash) or 'tiny' (random weights); "
            "default $CLEF_FLASH_MODEL or tiny",
        )
        command.add_argument("--revision", help="hub revision (branch, tag or commit) for a repo id")

    answer = sub.add_parser("answer", help="answer a System One request")
    add_request_arguments(answer)
    add_model_arguments(answer)
    answer.add_argument("--device", default=os.environ.get("CLEF_FLASH_DEVICE", "auto"), help="auto, cpu or cuda")
    answer.add_argument(
        "--precision", default=os.environ.get("CLEF_FLASH_PRECISION"), choices=["fp32", "bf16"], help="default bf16"
    )
    answer.add_argument("--json", action="store_true", help="print the System One response body")
    answer.add_argument("--table", action="store_true", help="print the readable table even when piped")
    answer.add_argument("--timings", action="store_true", help="add tokenize / decoder / head / total milliseconds")
    answer.set_defaults(run=command_answer)

    render = sub.add_parser("render", help="show the rendered prompt with question and option spans marked")
    add_request_arguments(render)
    add_model_arguments(render)
    render.add_argument("--max-length", type=int, help="token limit (default 65536)")
    render.set_defaults(run=command_render)
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
