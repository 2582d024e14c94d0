"""Converting a release into an 8-bit bundle: the Python API behind `clef-flash convert`.

    convert(source, destination)    the release's projections in the int8 scheme (checkpoint/quant.py), streamed

The scheme needs the weights alone (each projection smoothed by its norm's scale and rotated), so there is no
calibration pass: conversion reads each tensor once and writes it (checkpoint/bundle.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from .checkpoint import bundle


def convert(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    revision: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    verify: bool = False,
) -> Path:
    """Convert the release `source` (a directory, a hub id, "tiny") to a bundle at `destination`; `verify`: then
    check the written files against the manifest's checksums."""
    out = bundle.convert(source, destination, revision=revision, overwrite=overwrite, progress=progress)
    if verify:
        bundle.verify_checksums(out)
    return out
