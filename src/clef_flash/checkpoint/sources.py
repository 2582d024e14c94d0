"""Model sources and the `Checkpoint` they open into (the front door, `open_checkpoint`, is in __init__).

Sources, tried in this order:

    "tiny"              the generated random release (cached on disk; random weights, for smoke tests)
    "random:NAME[:SEED]" a random release of a named config (random_release.RANDOM_CONFIGS), drawn in
                        memory on demand: no file is written (the full 9B included)
    DIR with manifest.json   an 8-bit bundle (checkpoint/bundle.py): memory-mapped, int8 decoder projections
    DIR                 a release directory (SPEC §2): model*.safetensors (sharded or not) + the head
    OWNER/NAME          a Hugging Face repo id: downloaded once into the hub cache, then a release

A `Checkpoint` holds what the model is made from: the configs, the tokenizer, the decoder's and the
head's tensor sources (read lazily), whether the decoder is stored int8, and fingerprints. Nothing is
loaded into modules here: `loading.build_model(checkpoint, plan)` does that. A new kind of
source is one `open_*` function returning a `Checkpoint` and one branch of `open_checkpoint`.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ModelSourceError, WeightsError
from ..model.precision import WeightCounts, is_quantized, is_scale
from .names import DECODER_PREFIX, EMBEDDING, LM_HEAD, MTP_PREFIX, VISION_PREFIX
from .safetensors_io import SafetensorsFiles, TensorSource

if TYPE_CHECKING:
    from ..request.tokenizer import Tokenizer

HEAD_WEIGHTS = "joint_head.safetensors"
HEAD_CONFIG = "joint_head_config.json"
DEFAULT_REPO = "Cloudflare/clef-flash"
RANDOM_PREFIX = "random:"


PROCESSOR_CONFIG = "preprocessor_config.json"  # the image processor
VIDEO_PROCESSOR_CONFIG = "video_preprocessor_config.json"


@dataclass
class Checkpoint:
    """A model source, opened: configs, tokenizer and tensor sources, nothing loaded yet."""

    source: str  # as the user gave it
    kind: str  # "release", "bundle", "random" or "coreml" (an export: packages, no tensors)
    root: Path | None  # the directory, None for tensors drawn in memory
    config: dict  # config.json as read
    head_config: dict  # joint_head_config.json as read
    tokenizer_file: Path
    tensors: TensorSource | None  # the decoder (model.language_model.*) and lm_head.weight; None: a Core ML export
    head_tensors: TensorSource | None  # the joint head
    stored_int8: bool = False  # the decoder projections are stored int8 (a bundle)
    manifest: dict | None = None  # a bundle's manifest
    decoder_files: str = "model*.safetensors"  # for error messages
    processor_config: dict | None = None  # preprocessor_config.json (a release's image processor); None: text only
    video_processor_config: dict | None = None  # video_preprocessor_config.json; None: no videos

    @property
    def where(self) -> str:
        return str(self.root) if self.root is not None else self.source

    @property
    def is_random(self) -> bool:
        return "clef_flash_random" in self.config

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        from ..request.tokenizer import Tokenizer

        return Tokenizer.from_file(self.tokenizer_file)

    @functools.cached_property
    def image_processor(self):
        """The release's image processor (request/images.py), or None when it has none (text only)."""
        from ..request.images import ImageProcessorConfig

        return None if self.processor_config is None else ImageProcessorConfig.from_dict(self.processor_config)

    @functools.cached_property
    def video_processor(self):
        """The release's video processor (request/videos.py), or None when it has none (no videos)."""
        from ..request.videos import VideoProcessorConfig

        return None if self.video_processor_config is None else VideoProcessorConfig.from_dict(self.video_processor_config)

    def weight_counts(self) -> WeightCounts | None:
        """The model's parameters by how a precision holds them (model/precision.py `WeightCounts`; the output
        embeddings aside: their rows are gathered, never held whole, and the MTP layers, never loaded); None without
        tensors (a Core ML export). What the default precision weighs against memory (plan.py)."""
        if self.tensors is None:
            return None
        counts = dict.fromkeys(("projections", "embeddings", "vision", "head", "other"), 0)
        with_vision = self.processor_config is not None and "vision_config" in self.config
        for name in self.tensors.keys():
            shape = self.tensors.shape(name)
            if name == LM_HEAD or is_scale(name) or name.startswith(MTP_PREFIX) or (name.startswith(VISION_PREFIX) and not with_vision):
                continue
            if name.startswith(VISION_PREFIX):
                part = "vision"
            elif name == DECODER_PREFIX + EMBEDDING:
                part = "embeddings"
            else:
                part = "projections" if is_quantized(name, shape) else "other"
            counts[part] += math.prod(shape)
        counts["head"] = sum(math.prod(self.head_tensors.shape(name)) for name in self.head_tensors.keys())
        return WeightCounts(**counts)

    def layer_parameters(self) -> list[int]:
        """Each decoder layer's parameters, in layer order (what streaming holds one at a time; plan.py)."""
        counts: dict[int, int] = {}
        layers_prefix = DECODER_PREFIX + "layers."
        for name in self.tensors.keys() if self.tensors is not None else ():
            if name.startswith(layers_prefix) and not is_scale(name):
                index = int(name[len(layers_prefix) :].split(".", 1)[0])
                counts[index] = counts.get(index, 0) + math.prod(self.tensors.shape(name))
        return [counts[index] for index in sorted(counts)]

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the canonical JSON of config.json."""
        return config_fingerprint(self.config)

    @functools.cached_property
    def weights_fingerprint(self) -> str | None:
        return weights_fingerprint(self.root)

    @property
    def release_date(self) -> str:
        """The release's date as far as we can tell: when its config.json was written (UTC)."""
        config = self.root / "config.json" if self.root is not None else None
        stamp = config.stat().st_mtime if config is not None and config.is_file() else time.time()
        return datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc).date().isoformat()


def open_release(
    root: Path, *, source: str | None = None, files: Callable[[list[Path]], TensorSource] = SafetensorsFiles
) -> Checkpoint:
    """A release directory (SPEC §2), its tensors memory-mapped (or read by `files`, e.g. streamed)."""
    config = read_json(root / "config.json")
    head_config = read_json(root / HEAD_CONFIG)
    for name in ("tokenizer.json", HEAD_WEIGHTS):
        if not (root / name).is_file():
            raise ModelSourceError(f"{root} is not a Clef release: {name} is missing")
    return Checkpoint(
        source=source or str(root),
        kind="release",
        root=root,
        config=config,
        head_config=head_config,
        tokenizer_file=root / "tokenizer.json",
        tensors=files(release_files(root)),
        head_tensors=files([root / HEAD_WEIGHTS]),
        **processor_configs(root),
    )


def processor_configs(root: Path) -> dict[str, dict | None]:
    """A release's (or bundle's) image and video processor configs, as `Checkpoint` fields (None: absent)."""
    return {
        field: read_json(root / name) if (root / name).is_file() else None
        for field, name in (("processor_config", PROCESSOR_CONFIG), ("video_processor_config", VIDEO_PROCESSOR_CONFIG))
    }


def open_export(root: Path, *, source: str | None = None) -> Checkpoint:
    """A Core ML export directory (checkpoint/coreml_layout.py): the release's config it was made from, its tokenizer;
    the packages hold the weights (engine/coreml_backend.py runs them)."""
    from .coreml_layout import CONFIG, MANIFEST, TOKENIZER
    from .coreml_layout import read_json as read_export_json

    config = read_export_json(root / CONFIG)
    return Checkpoint(
        source=source or str(root),
        kind="coreml",
        root=root,
        config=config.get("release_config", {}),
        head_config={},
        tokenizer_file=root / TOKENIZER,
        tensors=None,
        head_tensors=None,
        stored_int8=True,
        manifest=read_export_json(root / MANIFEST),
        decoder_files="Core ML packages",
    )


def open_random(source: str) -> Checkpoint:
    """`random:NAME[:SEED]`: a random release drawn in memory, tensor by tensor, as it is loaded."""
    from .random_release import RandomTensors, release_config, resolve_config
    from .random_release import processor_configs as random_processor_configs
    from .vocab import cached_tokenizer_json

    name, _, seed_text = source.removeprefix(RANDOM_PREFIX).partition(":")
    try:
        config = resolve_config(name)
        seed = int(seed_text) if seed_text else 0
    except ValueError as exc:
        raise ModelSourceError(f"{source!r}: {exc} (write random:NAME or random:NAME:SEED)") from None
    return Checkpoint(
        source=source,
        kind="random",
        root=None,
        config=release_config(config, seed=seed),
        head_config=config.head_config(),
        tokenizer_file=cached_tokenizer_json(),
        tensors=RandomTensors.of_model(config, seed=seed),
        head_tensors=RandomTensors.of_head(config, seed=seed),
        decoder_files="random tensors",
        # As `write_random_release` writes them: a config with a vision tower reads images and videos.
        processor_config=random_processor_configs()[PROCESSOR_CONFIG],
        video_processor_config=random_processor_configs()[VIDEO_PROCESSOR_CONFIG],
    )


def resolve_source(source: str | os.PathLike[str], *, revision: str | None = None) -> Path:
    """A local directory for `source`: a directory, `"tiny"` (a generated random release), or a hub repo id."""
    text = os.fspath(source)
    if text == "tiny":
        from .random_release import tiny_release

        return tiny_release()
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelSourceError(f"{path} is a file; a model source is a release or bundle directory")
    looks_like_repo = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if not looks_like_repo:
        raise ModelSourceError(
            f"no model at {text!r}: give a release or bundle directory, 'tiny' (random weights, for a "
            f"smoke test) or a Hugging Face repo id such as {DEFAULT_REPO}"
        )
    return _download(text, revision)


def _download(repo_id: str, revision: str | None) -> Path:
    """Fetch a release from the Hugging Face hub once, into its cache (huggingface_hub)."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.md"]
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except Exception as exc:  # hub errors come in many classes; all mean "not here"
        raise ModelSourceError(_download_failed(repo_id, revision, exc)) from exc


def _download_failed(repo_id: str, revision: str | None, error: Exception) -> str:
    """One short line: why, and the `hf` command (huggingface_hub's CLI) to run where there is a network."""
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        why = "the hub is offline here (HF_HUB_OFFLINE is set)"
    elif isinstance(error, GatedRepoError):
        why = "the repo is gated: accept its terms and log in (`hf auth login`)"
    elif isinstance(error, (RepositoryNotFoundError, RevisionNotFoundError)):
        why = "the hub has no such repo or revision"
    elif isinstance(error, LocalEntryNotFoundError):
        why = "the hub cannot be reached and nothing is cached"
    else:
        why = f"the download failed ({type(error).__name__})"
    name = f"{repo_id}@{revision}" if revision else repo_id
    return f"cannot download {name!r}: {why}; elsewhere, `hf download {repo_id} --local-dir DIR`, then --model DIR"


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelSourceError(f"{path.parent} is not a Clef release: {path.name} is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelSourceError(f"{path} is not valid JSON: {exc}") from exc


def release_files(root: Path) -> list[Path]:
    """The decoder's safetensors files: those the index names (all present), else model*.safetensors."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        files = sorted({root / name for name in weight_map.values()})
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise WeightsError(f"{root}: shards listed in {index.name} are missing: {', '.join(missing)}")
    else:
        files = sorted(root.glob("model*.safetensors"))
    if not files:
        raise ModelSourceError(f"{root} is not a Clef release: no model*.safetensors")
    return files


def config_fingerprint(config: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a config (what /health reports)."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def weights_fingerprint(root: Path | None, sample_bytes: int = 1 << 16) -> str | None:
    """A cheap SHA-256 over a release or bundle directory, not a checksum of every weight.

    Small files (configs, index, manifest; < 1 MiB) are hashed whole; large ones (weights,
    tokenizer) by name, size, and their first and last `sample_bytes` — which cover the
    safetensors header and differ between any two random draws. Milliseconds even for 19 GB.
    """
    if root is None or not root.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(root).as_posix()}\0{size}\0".encode())
        with path.open("rb") as handle:
            if size < 1 << 20:
                digest.update(handle.read())
            else:
                digest.update(handle.read(sample_bytes))
                handle.seek(size - sample_bytes)
                digest.update(handle.read(sample_bytes))
    return digest.hexdigest()
