"""Loading: model sources (release, hub, bundle, random), safetensors I/O, int8 quantization, the bundle.

    open_checkpoint(source) -> Checkpoint        the front door, whatever the source (sources.py, bundle.py)
    build_model(checkpoint, precision, device)   strict loading into modules (loading.py)
"""

from __future__ import annotations

import os

from .bundle import is_bundle, open_bundle
from .loading import ModelParts, build_model
from .sources import RANDOM_PREFIX, Checkpoint, open_random, open_release, resolve_source


def open_checkpoint(source: str | os.PathLike[str], *, revision: str | None = None, verify: bool = False) -> Checkpoint:
    """Open a model source: "tiny", "random:NAME[:SEED]", a bundle or release directory, or a hub repo id.

    `verify` checks a bundle's sha256 checksums first. Nothing is loaded into modules yet.
    """
    text = os.fspath(source)
    if text.startswith(RANDOM_PREFIX):
        return open_random(text)
    root = resolve_source(text, revision=revision)
    if is_bundle(root):
        return open_bundle(root, source=text, verify=verify)
    return open_release(root, source=text)


__all__ = ["Checkpoint", "ModelParts", "build_model", "open_checkpoint"]
