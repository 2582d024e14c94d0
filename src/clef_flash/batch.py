"""Batch scoring: a JSONL file of requests (or of states plus schemas) to JSONL answers, resumable.

Input, one JSON value per line; blank lines are skipped but counted, so line numbers are the file's
(a `.parquet` file instead: each row is the JSON object of its columns, numbered from 1):
- requests: each line is a System One request; its top-level `"id"` (any JSON value) is carried over.
- states plus one or more schemas (`{"questions": {...}, "model"?: ...}`): a line that is an object
  with a `"state"` key is a row `{"state": ..., "id"?: ...}`; any other value (a string, an object
  without `"state"`, an array, a number) is the state itself. Each state is asked every schema; its
  prefix + state runs once (the engine keeps it), each schema's questions after it.

Output, one line per input line (per input line and schema, with several schemas), in input order:

    {"line": 3, "id": "ticket-17", "model": "clef-flash", "answers": {...}, "usage": {...}}
    {"line": 4, "id": 4, "error": {"detail": [...]}}
    {"line": 5, "id": 5, "schema": 1, ...}      with several schemas: which one (its --schema position, from 0)

`id` is the input's own id, exactly as given, or its line number when it has none; `error` is the
422 body the HTTP server would answer (not JSON, an invalid request, a record over the token limit).

Resuming. The output is its own progress record. Lines are scored in fixed blocks of `batch_size`
input lines (1..N, N+1..2N, ...), and each block is appended, flushed and fsynced. On a restart a
partial last line (a crash mid-write) is cut off and the line numbers already written are skipped;
a block cut short is scored again whole, and only its missing lines are written, so every record
has the same batch neighbours as in an uninterrupted run and the output equals that run's exactly
(with the same `batch_size`; another one resumes just as safely, but floats may move in the last bit).
`OUT.progress.json` records what the output was made from (the input's size and SHA-256, the
schemas', the model): resuming with anything else is refused.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint.safetensors_io import sha256_of
from .console import ProgressBar
from .errors import ClefError, RequestInvalid
from .request.protocol import parse_request, parse_request_json

if TYPE_CHECKING:
    from .clef import Clef

PROGRESS_FORMAT = "clef-flash-batch"
PROGRESS_VERSION = 1
DEFAULT_BATCH_SIZE = 32


def progress_path(output: Path) -> Path:
    return output.with_name(output.name + ".progress.json")


def read_schema(path: Path) -> dict[str, Any]:
    """A schema file: `{"questions": {...}}`, maybe with `"model"`; checked once, here."""
    try:
        schema = json.loads(path.read_bytes())
    except ValueError as exc:
        raise ClefError(f"schema file {path} is not JSON: {exc}") from exc
    if not isinstance(schema, dict) or "questions" not in schema or "state" in schema:
        raise ClefError(
            f"schema file {path} must be a JSON object with 'questions' (and optionally 'model'), "
            "without a 'state': the states come from the input lines"
        )
    try:
        parse_request({**schema, "state": ""})
    except RequestInvalid as error:
        raise ClefError(f"schema file {path} is not a valid schema: {error}") from error
    return schema


@dataclass(frozen=True)
class Row:
    """One input line: the request to answer, or why there is none."""

    line: int
    id: Any
    request: Any = None
    error: RequestInvalid | None = None
    schema: int | None = None  # with several schemas: which one this row asks

    @property
    def key(self) -> tuple[int, int | None]:
        return (self.line, self.schema)

    def head(self) -> dict[str, Any]:
        """The fields an output line starts with."""
        head = {"line": self.line, "id": self.id}
        if self.schema is not None:
            head["schema"] = self.schema
        return head


def decode_json(raw: bytes) -> Any:
    """A line's JSON value; an undecodable line raises the `json_invalid` error the server answers."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError
        parse_request_json(raw)  # raises RequestInvalid with the server's item
        raise


def schema_numbers(schemas: list[dict[str, Any]]) -> list[int | None]:
    """What each row of an input line says in `"schema"`: None unless there are several schemas."""
    return list(range(len(schemas))) if len(schemas) > 1 else [None]


def decode_rows(line: int, raw: bytes, schemas: list[dict[str, Any]]) -> list[Row]:
    """An input line's rows: the request itself, or its state with each schema (numbered when several)."""
    numbers = schema_numbers(schemas)
    try:
        value = decode_json(raw)
    except RequestInvalid as error:
        return [Row(line, line, error=error, schema=number) for number in numbers]
    if not schemas:
        row_id = value.get("id", line) if isinstance(value, dict) else line
        return [Row(line, row_id, request=value)]
    if isinstance(value, dict) and "state" in value:
        row_id, state = value.get("id", line), value["state"]
    else:
        row_id, state = line, value
    return [Row(line, row_id, request={**schema, "state": state}, schema=number) for schema, number in zip(schemas, numbers)]


def nonblank_lines(lines: Iterable[bytes], first: int = 1) -> Iterator[tuple[int, bytes]]:
    """(line number, content) of every non-blank line of `lines` (a binary file, or a block of one
    read back from memory), numbered from `first`."""
    for number, raw in enumerate(lines, start=first):
        if raw.strip():
            yield number, raw.rstrip(b"\r\n")


def is_parquet(path: Path) -> bool:
    return path.suffix.lower() in (".parquet", ".pq")


def parquet_lines(path: Path, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(row number from 1, the row as a JSON object) of rows `start..stop` (0-based, `stop` excluded)
    of a Parquet file; a column holding text stays text (with --schema, a `state` column is the state)."""
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ClefError('reading Parquet needs pyarrow: pip install pyarrow (or "clef-flash[ray]")') from None
    source = parquet.ParquetFile(path)
    stop = source.metadata.num_rows if stop is None else stop
    number = 0  # the first row of each row group; only the groups that hold start..stop are read
    for group in range(source.metadata.num_row_groups):
        rows = source.metadata.row_group(group).num_rows
        low, high = max(start, number), min(stop, number + rows)
        if low < high:
            table = source.read_row_group(group).slice(low - number, high - low)
            for offset, row in enumerate(table.to_pylist()):
                yield low + offset + 1, json.dumps(row, default=str).encode()  # ASCII: no surrogate can fail
        number += rows


def input_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, content) of every non-blank line; a Parquet file's rows as JSON objects."""
    if is_parquet(path):
        yield from parquet_lines(path)
        return
    with open(path, "rb") as handle:
        yield from nonblank_lines(handle)


def read_jsonl(path: str | os.PathLike[str]) -> list[tuple[int, Any]]:
    """(line number, value) of every non-blank line of a JSONL file; a line that is not JSON is an
    error naming it (for files read whole, such as eval's; `batch` turns such a line into an error object)."""
    path = Path(path)
    if not path.is_file():
        raise ClefError(f"no input file at {path}")
    values = []
    for number, raw in input_lines(path):
        try:
            values.append((number, decode_json(raw)))
        except RequestInvalid as error:
            raise ClefError(f"{path} line {number}: {error.errors[0]['msg']}") from error
    return values


def score_rows(model: Clef, rows: list[Row]) -> list[dict[str, Any]]:
    """One output object per row, in order; the valid rows are scored in one `Clef.score` call."""
    outputs: list[dict[str, Any] | None] = [None] * len(rows)
    valid = []  # (position, prepared request)
    for position, row in enumerate(rows):
        error = row.error
        if error is None:
            try:
                valid.append((position, model.prepare(row.request)))
                continue
            except RequestInvalid as invalid:
                error = invalid
        outputs[position] = {**row.head(), "error": error.detail()}
    results = model.score([prepared.record for _, prepared in valid])
    for (position, prepared), per_question in zip(valid, results):
        outputs[position] = {**rows[position].head(), **model.respond(prepared, per_question)}
    return outputs  # type: ignore[return-value]


OutputLine = tuple[tuple[int, "int | None"], bytes, bool]
"""One output line as written: its row's (input line, schema) key, its bytes, whether it is an error."""


def score_block(model: Clef, rows: list[Row]) -> list[OutputLine]:
    """A block's output lines, in row order (what a local job and a Ray worker both write)."""
    return [(row.key, json_line(output), "error" in output) for row, output in zip(rows, score_rows(model, rows))]


def json_line(value: Any) -> bytes:
    text = json.dumps(value, ensure_ascii=False)
    try:
        return (text + "\n").encode()
    except UnicodeEncodeError:  # a lone surrogate (legal as a JSON escape) in an id: keep it escaped
        return (json.dumps(value) + "\n").encode()


def completed_lines(output: Path) -> set[tuple[int, int | None]]:
    """The (input line, schema) pairs already in `output`, after cutting off a partial last line."""
    data = output.read_bytes()
    complete = data.rfind(b"\n") + 1
    if complete < len(data):
        os.truncate(output, complete)  # a crash mid-write: that line is scored again
    done = set()
    for number, raw in enumerate(data[:complete].splitlines(), start=1):
        try:
            written = json.loads(raw)
            done.add((int(written["line"]), written.get("schema")))
        except (ValueError, KeyError, TypeError) as exc:
            raise ClefError(
                f"{output} line {number} is not a clef-flash batch output line; "
                "give another OUT, or --overwrite to start over"
            ) from exc
    return done


def model_words(model: Any) -> str:
    """`{"source": "tiny", "precision": "fp32", "revision": None}` -> "source tiny, precision fp32"."""
    if not isinstance(model, dict):
        return repr(model)
    return ", ".join(f"{key} {value}" for key, value in model.items() if value is not None)


def describe_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between the job a progress file records and this one, in words."""
    differences = []
    if (recorded.get("format"), recorded.get("version")) != (current["format"], current["version"]):
        differences.append(f"a progress file of format {recorded.get('format')!r} v{recorded.get('version')}")
    if (recorded.get("input_bytes"), recorded.get("input_sha256")) != (current["input_bytes"], current["input_sha256"]):
        differences.append(f"its input was {recorded.get('input')}, not this file's content")
    if recorded.get("schema_sha256") != current["schema_sha256"]:
        differences.append("other schemas" if current["schema_sha256"] else "a schema, and this run has none")
    if recorded.get("model") != current["model"]:
        differences.append(f"its model was {model_words(recorded.get('model'))}, this run's is {model_words(current['model'])}")
    return differences


def check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ClefError(f"--batch-size must be at least 1; got {batch_size}")


@dataclass
class Summary:
    written: int  # lines written by this run
    errors: int  # of which error objects
    skipped: int  # lines already in the output
    seconds: float
    notes: list[str] = field(default_factory=list)  # what the run met and said (a Ray worker's other plan)


class BatchJob:
    """An input file, an output file and what the output is made from. `open` checks everything
    and writes nothing; `run` starts the output (a fresh job) or appends what is missing."""

    def __init__(
        self,
        input_path: Path,
        output: Path,
        schemas: list[dict[str, Any]],
        made_from: dict[str, Any],
        done: set[tuple[int, int | None]] | None,
    ):
        self.input_path = input_path
        self.output = output
        self.schemas = schemas
        self.made_from = made_from  # what the progress file records
        self.fresh = done is None  # no output of this job yet (or --overwrite)
        self.done = done or set()  # (input line, schema) pairs already in the output

    @classmethod
    def open(
        cls,
        input_path: str | os.PathLike[str],
        output: str | os.PathLike[str],
        *,
        schema_path: str | os.PathLike[str] | list[str | os.PathLike[str]] | None = None,
        model: dict[str, Any],
        overwrite: bool = False,
    ) -> BatchJob:
        """`model` describes the model for the progress file (source, revision, precision, ...);
        `schema_path`: one schema file or several (each state is asked every one)."""
        input_path, output = Path(input_path), Path(output)
        if not input_path.is_file():
            raise ClefError(f"no input file at {input_path}")
        if output.exists() and output.resolve() == input_path.resolve():
            raise ClefError("the output file is the input file; give another OUT")
        made_from: dict[str, Any] = {
            "format": PROGRESS_FORMAT,
            "version": PROGRESS_VERSION,
            "input": str(input_path.resolve()),
            "input_bytes": input_path.stat().st_size,
            "input_sha256": sha256_of(input_path),
            "schema_sha256": None,
            "model": model,
        }
        paths = [] if schema_path is None else [schema_path] if isinstance(schema_path, (str, os.PathLike)) else schema_path
        schemas = []
        for path in map(Path, paths):
            if not path.is_file():
                raise ClefError(f"no schema file at {path}")
            schemas.append(read_schema(path))
        checksums = [sha256_of(path) for path in paths]
        made_from["schema_sha256"] = (checksums[0] if len(checksums) == 1 else checksums) or None

        sidecar = progress_path(output)
        if overwrite or not output.exists() or (output.stat().st_size == 0 and not sidecar.exists()):
            return cls(input_path, output, schemas, made_from, None)
        if not sidecar.is_file():
            raise ClefError(
                f"{output} exists but has no {sidecar.name}, so it was not written by clef-flash batch; "
                "give another OUT, or --overwrite to replace it"
            )
        try:
            recorded = json.loads(sidecar.read_text())
        except ValueError as exc:
            raise ClefError(f"{sidecar} is not JSON; use --overwrite to start over") from exc
        differences = describe_differences(recorded, made_from)
        if differences:
            raise ClefError(
                f"{output} was made from another job ({'; '.join(differences)}): rerun that job's command to resume "
                "it, or add --overwrite to start over"
            )
        return cls(input_path, output, schemas, made_from, completed_lines(output))

    def _start(self) -> None:
        # Empty the output first: a crash in between leaves an empty output (a fresh start) or
        # an old progress file beside an empty output (refused for another job), never old lines.
        self.output.write_bytes(b"")
        sidecar = progress_path(self.output)
        staging = sidecar.with_name(sidecar.name + ".tmp")
        staging.write_text(json.dumps(self.made_from, indent=2) + "\n")
        os.replace(staging, sidecar)
        self.fresh = False

    def total(self) -> int:
        """Output lines a finished job has."""
        return sum(1 for _ in input_lines(self.input_path)) * max(1, len(self.schemas))

    def blocks(self, batch_size: int) -> Iterator[list[Row]]:
        """The rows of each fixed block of `batch_size` input lines (1..N, N+1..2N, ...) that still has
        a line to write: the whole block, done lines included, so it is the same batch as in an
        uninterrupted run."""
        for _, block in itertools.groupby(input_lines(self.input_path), key=lambda item: (item[0] - 1) // batch_size):
            rows = [row for number, raw in block for row in decode_rows(number, raw, self.schemas)]
            if not all(row.key in self.done for row in rows):
                yield rows

    def append(self, blocks: Iterable[list[OutputLine]], progress: ProgressBar | None = None) -> Summary:
        """Write the lines of each scored block that the output lacks, block by block in the order
        given, each block appended, flushed and fsynced: what a rerun resumes from."""
        if self.fresh:
            self._start()
        start = time.perf_counter()
        written = errors = 0
        with open(self.output, "ab") as sink:
            for block in blocks:
                missing = [(line, error) for key, line, error in block if key not in self.done]
                sink.write(b"".join(line for line, _ in missing))
                sink.flush()
                os.fsync(sink.fileno())
                written += len(missing)
                errors += sum(error for _, error in missing)
                if progress is not None:
                    progress.advance(len(missing))
        if progress is not None:
            progress.finish()
        return Summary(written=written, errors=errors, skipped=len(self.done), seconds=time.perf_counter() - start)

    def run(
        self, model: Clef, *, batch_size: int = DEFAULT_BATCH_SIZE, progress: ProgressBar | None = None
    ) -> Summary:
        """Score what the output lacks, in this process (`distributed.ray_batch` does it on Ray)."""
        check_batch_size(batch_size)
        return self.append((score_block(model, rows) for rows in self.blocks(batch_size)), progress)
