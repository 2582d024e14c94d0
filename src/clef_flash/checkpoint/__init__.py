"""Loading: model sources (release, hub, bundle, random, Core ML export), safetensors I/O, int8 quantization, the bundle.

    open_checkpoint(source) -> Checkpoint        the front door, whatever the source (sources.py, bundle.py)
    build_model(checkpoint, plan)                strict loading into modules (loading.py; plan.py says how)
    write_random_release(dir, config)            a random release in the real layout (random_release.py; `tiny`)
"""

from __future__ import annotations

import os

from .bundle import is_bundle, open_bundle
from .loading import ModelParts, build_model
from .sources import RANDOM_PREFIX, Checkpoint, open_export, open_random, open_release, resolve_source
from .coreml_layout import is_export

_LAZY = {"RANDOM_CONFIGS": "random_release", "write_random_release": "random_release"}


def __getattr__(name: str):
    # The random releases build the model's modules (torch's attention, dynamo): imported on first use, not by every
    # `import clef_flash.checkpoint` (the command line's parser).
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_checkpoint(source: str | os.PathLike[str], *, revision: str | None = None, verify: bool = False) -> Checkpoint:
    """Open a model source: "tiny", "random:NAME[:SEED]", a bundle or release directory, or a hub repo id.

    `verify` checks a bundle's sha256 checksums first. Nothing is loaded into modules yet. A Core ML export
    (`clef-flash export coreml`) opens as a checkpoint of kind "coreml" with no tensors: its packages run it.
    """
    text = os.fspath(source)
    if text.startswith(RANDOM_PREFIX):
        return open_random(text)
    root = resolve_source(text, revision=revision)
    if is_export(root):
        return open_export(root, source=text)
    if is_bundle(root):
        return open_bundle(root, source=text, verify=verify)
    return open_release(root, source=text)


__all__ = ["RANDOM_CONFIGS", "Checkpoint", "ModelParts", "build_model", "open_checkpoint", "write_random_release"]
