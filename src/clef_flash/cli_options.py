"""The command line's options, each written once: validators, `Arg`, the model options every model command shares
(each flag's dest a keyword of `clef_flash.load`), serve's and mcp's flags generated from `ServerSettings`, Ray's.
"""

from __future__ import annotations

import argparse
import copy
import os
from dataclasses import dataclass
from typing import Any

from .coreml import RUNNERS
from .device_io import CAPTURE_MODES
from .plan import PRECISION_CHOICES
from .request.records import DEFAULT_MAX_LENGTH
from .server.settings import ServerSettings


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


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, e.g. 0.3; got {text}")
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
    arg("--graphs", choices=CAPTURE_MODES, help="on a GPU: lazy (the default: each step shape captured as a CUDA graph on first "
        "use), load (every bucket's at load: slower to start), eager (no capture) or off (not through the graph pool)"),
    arg("--coreml-runner", choices=RUNNERS, help="for a Core ML export: coreml (the default; macOS) or torch (its traced fp32 twins, "
        "rebuilt from the source it was exported from: checks an export anywhere before it goes to a Mac)"),
    ADAPTER := arg("--adapter", action="append", metavar="[NAME=]DIR", help="a clef-finetune checkpoint (adapter/ + "
        "joint_head.safetensors) run beside the base: DIR answers as the fine-tune; NAME=DIR (repeat it for many) answers the "
        "requests whose 'adapter' field is NAME, the others get the base. eval labelled: the base and the tuned model side by side"),
    CALIBRATION := arg("--calibration", metavar="FILE", help="temperatures fitted by `eval labelled --fit-calibration`: each "
        "question they name answers softmax(logits / T) (decisions unchanged), and every response says so in its 'calibration' field"),
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
RANDOM_NAMES = "tiny, tiny-vision, 9b-heads, 9b-heads-outliers, 9b-heads-1024, 9b-part, 9b, 27b-part, 27b"  # checkpoint.RANDOM_CONFIGS (test_cli holds them)
OVERWRITE = arg("--overwrite", action="store_true", help="replace an existing destination")

