"""`load`: the front door. A source opens into a checkpoint (checkpoint/), the plan is resolved once
(plan.py), the backend is built from both (engine/), and the facade (clef.py) is returned.

    load("tiny") / load(DIR) / load("Cloudflare/clef-flash") / load("random:9b-part")   torch backend
    load(EXPORT)                         a Core ML export: Core ML on macOS
    load(EXPORT, coreml_runner="torch")  the export's traced fp32 twins standing in for Core ML (anywhere)
    resolve_plan(source, ...)            the plan `load` would run in, nothing built (batch's progress file)
    open_encoder(source)                 requests to token ids and spans, no weights (`clef-flash render`)
    load(..., calibration=FILE)          answers through fitted temperatures (calibration.py)
"""

from __future__ import annotations

import os
from typing import Any
from collections.abc import Mapping

import torch

from .calibration import Calibration, as_calibration
from .checkpoint import Checkpoint, open_checkpoint
from .checkpoint.adapters import adapter_name_of, adapter_options, named_paths, read_adapters, side_by_side
from .coreml.host import Runner
from .clef import Clef, Encoder
from . import device_io
from .engine import DEFAULT_BATCH_TOKENS, GPU_BATCH_TOKENS, KEEP_FROM_TOKENS, Engine
from .errors import ClefError
from .machine import available_memory_bytes, cuda_gpu
from .machine import rates as machine_rates
from .plan import COREML, Plan, coreml_plan, resolve
from .prefill import DEFAULT_SEGMENT_TOKENS
from .request.records import DEFAULT_MAX_LENGTH
from .state_cache import MEBIBYTE, StateCache, default_state_cache_mb


def pick_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ClefError(f"unknown device {device!r}: use 'auto', 'cpu' or 'cuda'") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ClefError("device 'cuda' was asked for, but no CUDA device is available")
    return resolved


def plan_of(
    checkpoint: Checkpoint,
    *,
    device: str | torch.device = "auto",
    precision: str | None = None,
    coreml_runner: Runner | str | None = None,
    fit_memory: bool = False,
    for_workers: bool = False,
) -> Plan:
    """The plan `load` runs `checkpoint` in, decided without building anything (batch's progress file,
    Ray's engine spec): a Core ML export runs as exported; anything else is resolved on this machine
    (`fit_memory`: `precision` streamed if it does not fit this machine's memory whole, `plan.resolve`).
    `for_workers`: the plan of other machines' `device` (Ray's GPU workers), which this one need not have: a CUDA
    plan resolved without a CUDA device here takes no int8 tensor cores for granted (bf16, its reason says why)."""
    if checkpoint.kind == "coreml":
        if precision is not None:
            raise ClefError(f"{checkpoint.where} is a Core ML export: it runs as exported (8-bit weights, fp16); leave precision unset")
        runner = coreml_runner or "coreml"
        return coreml_plan(runner if isinstance(runner, str) else type(runner).__name__)
    if coreml_runner is not None:
        raise ClefError(f"{checkpoint.where} is not a Core ML export: --coreml-runner applies to exports only")
    return resolve(
        checkpoint,
        torch.device(device) if for_workers and str(device) != "auto" else pick_device(device),
        precision,
        rates=machine_rates,
        available_memory=available_memory_bytes,
        fit_memory=fit_memory,
        gpu=cuda_gpu,
    )


def resolve_plan(
    source: str | os.PathLike[str] = "tiny",
    *,
    device: str | torch.device = "auto",
    precision: str | None = None,
    revision: str | None = None,
    coreml_runner: str | Runner | None = None,
    fit_memory: bool = False,
) -> Plan:
    """The plan `load(source, ...)` would run in on this machine, without loading any weights (`fit_memory`: as
    `plan_of`)."""
    checkpoint = open_checkpoint(source, revision=revision)
    return plan_of(checkpoint, device=device, precision=precision, coreml_runner=coreml_runner, fit_memory=fit_memory)


def describe_adapters(source: str | os.PathLike[str], values: list[str], *, revision: str | None = None) -> list[dict[str, Any]]:
    """The command line's `--adapter` values (`adapter_options`) read and checked against `source`'s config, without
    building the base: each adapter's name, rank, projections, bytes and path (what `info` lists)."""
    paths = named_paths(adapter_options(values))
    return [item.describe() for item in read_adapters(open_checkpoint(source, revision=revision), paths).values()]


def describe_calibration(source: str | os.PathLike[str], path: str | os.PathLike[str], *, revision: str | None = None) -> dict[str, Any]:
    """The command line's `--calibration` file read and checked against `source`'s config, no weights loaded (`info`)."""
    calibration = as_calibration(path)
    calibration.check_model(open_checkpoint(source, revision=revision).fingerprint)
    return calibration.describe()


def open_encoder(source: str | os.PathLike[str] = "tiny", *, revision: str | None = None, max_length: int | None = None) -> Encoder:
    """What `load(source)` encodes requests with (its tokenizer and processors), without loading any weights."""
    return Encoder(open_checkpoint(source, revision=revision), max_length=max_length)


def load(
    source: str | os.PathLike[str] = "tiny",
    *,
    device: str | torch.device = "auto",
    precision: str | None = None,
    revision: str | None = None,
    max_length: int | None = DEFAULT_MAX_LENGTH,
    batch_tokens: int | None = None,
    verify: bool = False,
    resident_layers: int | None = None,
    segment_tokens: int | None = DEFAULT_SEGMENT_TOKENS,
    state_cache_mb: float | None = None,
    coreml_runner: str | Runner | None = None,
    adapter: str | os.PathLike[str] | None = None,
    adapters: Mapping[str, str | os.PathLike[str]] | None = None,
    plan: Plan | None = None,
    graphs: str | None = None,
    calibration: str | os.PathLike[str] | Calibration | None = None,
) -> Clef:
    """Load a model: a release or bundle directory, a Core ML export, a Hugging Face repo id, "tiny" (a
    generated random release) or "random:NAME[:SEED]" (random weights drawn in memory; names in RANDOM_CONFIGS).
    `max_length`: the token limit of a record (None: DEFAULT_MAX_LENGTH, 65,536).

    `precision` (model/precision.py): fp32, bf16, fp64, int8 (= int8-weight-only) or int8-w8a8; None:
    $CLEF_FLASH_PRECISION, else the fastest path qualified for this checkpoint on this machine (`Clef.plan`
    says which, with which kernel, and why; `clef-flash info`). A bundle (`clef-flash convert`) is int8 and
    memory-mapped; `verify` checks its files' sha256 first. A release loads in any precision (int8: quantized
    while loading). `resident_layers` (low-memory mode): at most that many decoder layers hold weights at
    once, each filled from the memory-mapped files just before it runs (slower: every forward reads every
    layer). `segment_tokens`: the most tokens of a record one decoder step runs (prefill.py; None: 2048).
    `batch_tokens`: the padded tokens one decoder forward takes (None: 8192 on a CPU, 32768 on a GPU).
    `state_cache_mb`: the bound of the state cache (state_cache.py); None: an eighth of this machine's
    memory, at most 4 GiB; 0: off (records of one call still share their states).
    A Core ML export runs as exported (no `precision`); `coreml_runner`: "coreml" (the default; macOS only)
    or "torch" (its traced fp32 twins, rebuilt from the source it was exported from). `plan`: run in this plan
    (from `resolve_plan` on this machine), not one resolved again. `graphs` (a GPU): how whole decoder steps are
    captured as CUDA graphs (engine/graphs.py): "lazy" (the default: each shape on first use), "load" (every
    bucket's at load), "eager" (no capture) or "off" (not through the graph pool).
    `adapter`: a clef-finetune checkpoint directory (adapter/ + joint_head.safetensors) that answers as the
    fine-tune does (merged into 16/32-bit weights; kept apart beside int8 ones). `adapters`: name -> checkpoint
    directory, loaded beside one copy of the base; a request picks one by its `adapter` field (left out: the
    `adapter` given here, else the base). Strict: an adapter for another base, without its head, or with a PEFT
    option that is not plain LoRA is refused (checkpoint/adapters.py).
    `calibration`: a file of fitted temperatures (`clef-flash eval labelled FILE --fit-calibration OUT`; or a
    `Calibration`): each question it names answers softmax(logits / T), the decision unchanged, and every response
    carries a `calibration` field (calibration.py). Read and checked against the model before any weights load.
    """
    from .engine.coreml_backend import CoreMLBackend
    from .engine.torch_backend import TorchBackend

    paths = {name: os.fspath(path) for name, path in (adapters or {}).items()}
    default_adapter = None
    if adapter is not None:
        default_adapter = adapter_name_of(adapter)
        if paths.get(default_adapter, os.fspath(adapter)) != os.fspath(adapter):
            raise ClefError(f"two adapters are named {default_adapter!r}: name the default one apart (adapters={{NAME: DIR}})")
        paths[default_adapter] = os.fspath(adapter)

    calibrated = as_calibration(calibration)
    checkpoint = open_checkpoint(source, revision=revision, verify=verify)
    if calibrated is not None:
        calibrated.check_model(checkpoint.fingerprint)
    plan = plan or plan_of(checkpoint, device=device, precision=precision, coreml_runner=coreml_runner)
    if plan.backend == COREML:
        if paths:
            raise ClefError(f"{checkpoint.where} is a Core ML export: adapters run on the torch backend (load the release)")
        backend = CoreMLBackend(checkpoint, plan, runner=coreml_runner or "coreml", verify=verify)
    else:
        read = read_adapters(checkpoint, paths) if paths else None  # checked before the base is built
        if calibrated is not None and read:
            calibrated.check_model(checkpoint.fingerprint, {name: item.fingerprint for name, item in read.items()})
        resident_layers = resident_layers or plan.resident_layers  # the default streams what does not fit
        segment_tokens = DEFAULT_SEGMENT_TOKENS if segment_tokens is None else segment_tokens
        backend = TorchBackend(
            checkpoint, plan, resident_layers=resident_layers, segment_tokens=segment_tokens, adapters=read, default_adapter=default_adapter,
            graphs=graphs,
        )
    cache_mb = default_state_cache_mb() if state_cache_mb is None else state_cache_mb
    if cache_mb < 0:
        raise ClefError(f"state_cache_mb must be 0 (off) or more, not {cache_mb}")
    identity = "|".join(map(str, (checkpoint.source, checkpoint.fingerprint, checkpoint.weights_fingerprint, backend.plan.key)))
    loaded = getattr(backend, "adapters", None)
    if loaded is not None:  # a merged adapter changes the decoder; the others' states are keyed by name too
        identity += "|" + ",".join(f"{name}={item.fingerprint}" for name, item in loaded.adapters.items()) + f"|merged={loaded.merged}"
    if batch_tokens is None:  # a forward's padded tokens: more on a GPU, where a bigger forward costs little more
        batch_tokens = GPU_BATCH_TOKENS if device_io.is_gpu(backend.plan.device) else DEFAULT_BATCH_TOKENS
    engine = Engine(backend, StateCache(int(cache_mb * MEBIBYTE), identity), batch_tokens=batch_tokens, keep_from_tokens=KEEP_FROM_TOKENS)
    return Clef(checkpoint, engine, max_length=max_length, calibration=calibrated)
