"""Scale out on Ray (`pip install "clef-flash[ray]"`): many engines, the same answers as one machine.

    ray_batch.py   `clef-flash batch --ray`: Ray Data reads the input in fixed blocks, one engine per
                   actor scores them, the driver appends each block in order (resumable as locally)
    ray_serve.py   `clef-flash serve --ray`: Ray Serve replicas of the local server's own app, its model
                   queue `@serve.batch` instead of a worker thread, behind a front on the head node
    forwarding.py  the front's forwarding (a request lost with its replica forwarded once more, else 503)
                   and the app called in-process on the replica's side

What goes to a worker is an `EngineSpec`: the model source (a directory path, a hub id, "tiny") and
the precision the driver resolved, never weights; each worker opens the source and loads it itself.
Nothing here imports ray at import time, and `import clef_flash` never imports this package.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ClefError

if TYPE_CHECKING:
    from ..clef import Clef

RAY_MISSING = 'Ray is not installed: pip install "clef-flash[ray]"'


def require_ray() -> Any:
    """The `ray` module, or a one-line ClefError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ClefError(RAY_MISSING) from None
    return ray


def connect(address: str | None = None) -> bool:
    """Join the Ray cluster at `address` ("auto", "HOST:6379", "ray://HOST:10001"; None: $RAY_ADDRESS, else
    a new local cluster of this machine's CPUs and GPUs). Already connected: nothing. True when this call connected."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    if address is None and not os.environ.get("RAY_ADDRESS"):
        ray.init(include_dashboard=False, configure_logging=False)
    else:
        ray.init(address=address, configure_logging=False)
    return True


@dataclass(frozen=True)
class EngineSpec:
    """What a worker builds its engine from: plain values, shipped to every worker; no weights.

    `source` is made absolute when it is a local directory, so it must exist at that path on every node
    (a shared filesystem, or the same copy); a hub id is downloaded by each node into its own cache.
    The fingerprints are the driver's: a worker whose copy differs refuses to score."""

    source: str
    precision: str  # resolved once, on the driver
    device: str = "cpu"
    revision: str | None = None
    max_length: int | None = None
    state_cache_mb: float | None = None
    segment_tokens: int | None = None
    resident_layers: int | None = None
    coreml_runner: str | None = None  # a Core ML export: what runs it (it runs as exported: no precision)
    graphs: str | None = None  # on a GPU: how whole decoder steps are captured (engine/graphs.py); None: lazily
    threads: int | None = None  # torch intra-op threads of each worker; None: torch's default
    fingerprint: str | None = None  # config, then weights: what the driver opened
    weights_fingerprint: str | None = None
    plan_key: str | None = None  # the driver's whole plan (`Plan.key`: precision, W8A8 kernel, device): every engine's
    verify: bool = False  # each worker checks the weights' hashes as `load(verify=True)` does
    calibration: Any = None  # a Calibration (its temperatures, read on the driver: no worker needs the file)

    @classmethod
    def resolve(cls, source: str, *, precision: str | None, device: str, revision: str | None = None, **options: Any) -> EngineSpec:
        """The spec for `source` on `device` ("cpu" or "cuda"): the precision resolved here, once, as
        `load` would resolve it there (the default: this machine's probe for a CPU, bf16 on CUDA)."""
        import torch

        from ..checkpoint import open_checkpoint
        from ..checkpoint.sources import RANDOM_PREFIX
        from ..loader import plan_of

        checkpoint = open_checkpoint(source, revision=revision)
        if options.get("calibration") is not None:
            from ..calibration import as_calibration

            options["calibration"] = as_calibration(options["calibration"])
            options["calibration"].check_model(checkpoint.fingerprint)
        plan = plan_of(
            checkpoint, device=torch.device(device), precision=precision, coreml_runner=options.get("coreml_runner"), for_workers=True
        )  # (the workers' GPUs: a head without one resolves their default as bf16, having no capability to read)
        local = str(source) != "tiny" and not str(source).startswith(RANDOM_PREFIX) and Path(source).expanduser().is_dir()
        shipped = str(Path(source).expanduser().resolve()) if local else str(source)  # a hub id: each node downloads it
        return cls(
            source=shipped,
            precision=plan.name,
            device=device,
            revision=revision,
            fingerprint=checkpoint.fingerprint,
            weights_fingerprint=checkpoint.weights_fingerprint,
            plan_key=plan.key,
            **options,
        )

    def load(self) -> Clef:
        """Build the engine (in a worker): `clef_flash.load` with these options, then check that it is
        the model the driver opened."""
        import torch

        from ..loader import load

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        options = {
            name: value
            for name, value in (
                ("max_length", self.max_length),
                ("state_cache_mb", self.state_cache_mb),
                ("segment_tokens", self.segment_tokens),
                ("resident_layers", self.resident_layers),
                ("coreml_runner", self.coreml_runner),
                ("graphs", self.graphs),
                ("calibration", self.calibration),
            )
            if value is not None
        }
        from ..loader import resolve_plan
        from ..model.precision import COREML_PRECISION

        precision = None if self.precision == COREML_PRECISION.name else self.precision  # an export runs as exported
        # The driver's precision, streamed here when this node's memory does not hold it whole (not part of the plan's
        # key: the answers are the same), unless the spec fixes resident_layers.
        plan = resolve_plan(
            self.source, device=self.device, precision=precision, revision=self.revision,
            coreml_runner=self.coreml_runner, fit_memory=self.resident_layers is None,
        )
        model = load(self.source, plan=plan, revision=self.revision, verify=self.verify, **options)
        loaded = (model.checkpoint.fingerprint, model.checkpoint.weights_fingerprint)
        if self.fingerprint is not None and loaded != (self.fingerprint, self.weights_fingerprint):
            raise ClefError(
                f"the worker on {os.uname().nodename} opened another model at {self.source!r} than the driver did "
                f"(config and weights fingerprints {loaded[0][:12]}, {str(loaded[1])[:12]}; the driver's "
                f"{self.fingerprint[:12]}, {str(self.weights_fingerprint)[:12]}): give every node the same copy"
            )
        if self.plan_key is not None and model.plan.key != self.plan_key:  # e.g. another W8A8 kernel on another CPU
            raise ClefError(
                f"the worker on {os.uname().nodename} resolved another plan than the driver ({model.plan.key}; the "
                f"driver's {self.plan_key}): one output never mixes plans; pass a --precision every node runs alike "
                "(fp32, bf16, int8-weight-only), or use nodes of one kind of CPU"
            )
        return model


__all__ = ["RAY_MISSING", "EngineSpec", "connect", "require_ray"]
