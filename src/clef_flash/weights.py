"""Reading a release: where it is, which tensors it holds, and strict loading into our modules.

A release (SPEC §2) holds the decoder under `model.language_model.*`, the output embeddings
`lm_head.weight`, and the head in `joint_head.safetensors`. Loading is strict: a tensor the model
needs that is missing, one we do not know, or one of the wrong shape is an error that lists them,
sorted. Only the vision tower (`model.visual.*`) and the multi-token-prediction layers (`mtp.*`) are
skipped, by name. Modules are built on the meta device and filled tensor by tensor from the
memory-mapped files, so loading never holds two copies of the weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Protocol

import torch
from torch import nn

from .errors import ModelSourceError, WeightsError
from .quant import SCALE_SUFFIX, QuantizingSource, replace_linears

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

DECODER_PREFIX = "model.language_model."
LM_HEAD = "lm_head.weight"
EMBEDDING = "embed_tokens.weight"  # relative to the decoder
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # safetensors' dtype codes
IGNORED_PREFIXES = ("model.visual.", "mtp.")
HEAD_WEIGHTS = "joint_head.safetensors"
HEAD_CONFIG = "joint_head_config.json"
RELEASE_FILES = ("config.json", HEAD_WEIGHTS, HEAD_CONFIG, "tokenizer.json")
DEFAULT_REPO = "Cloudflare/clef-flash"


def resolve_source(source: str | os.PathLike[str], *, revision: str | None = None) -> Path:
    """A local directory for `source`: a directory, `"tiny"` (a generated random release), or a hub repo id."""
    text = os.fspath(source)
    if text == "tiny":
        from .testing import tiny_release

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
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise ModelSourceError("loading from the hub needs huggingface_hub (pip install huggingface_hub)") from exc
    patterns = ["*.json", "*.safetensors", "*.md"]
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except Exception as exc:  # hub errors come in many classes; all mean "not here"
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = (
            "the hub is offline (HF_HUB_OFFLINE is set)"
            if offline
            else f"downloading it failed ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})"
        )
        raise ModelSourceError(
            f"cannot get {repo_id!r}{'@' + revision if revision else ''} from the Hugging Face hub: {hint}. "
            f"Point --model at a local copy instead (e.g. `huggingface-cli download {repo_id} --local-dir DIR` "
            f"on a machine with a network, then --model DIR)"
        ) from exc


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelSourceError(f"{path.parent} is not a Clef release: {path.name} is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelSourceError(f"{path} is not valid JSON: {exc}") from exc


class SafetensorsFiles:
    """The tensors of a (possibly sharded) set of safetensors files, memory-mapped, by name."""

    def __init__(self, files: Iterable[Path]):
        from safetensors import safe_open

        self._handles = {}
        self._location: dict[str, str] = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:
                raise WeightsError(f"cannot open {path}: {exc}") from exc
            self._handles[str(path)] = handle
            for name in handle.keys():
                self._location[name] = str(path)

    @classmethod
    def of_release(cls, root: Path) -> "SafetensorsFiles":
        return cls(cls.release_files(root))

    @staticmethod
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

    def keys(self) -> set[str]:
        return set(self._location)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._location[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._handles[self._location[name]].get_slice(name).get_dtype()
        return SAFETENSORS_DTYPES[code]

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self._location[name]].get_tensor(name)


@dataclass(frozen=True)
class KeyReport:
    missing: list[str]
    unexpected: list[str]
    misshapen: list[str]

    def raise_if_any(self, where: str) -> None:
        problems = []
        for label, names in (("missing", self.missing), ("unexpected", self.unexpected), ("wrong shape", self.misshapen)):
            if names:
                shown = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
                problems.append(f"{label}: {shown}")
        if problems:
            raise WeightsError(f"{where} does not match the model: " + "; ".join(problems))


def check_keys(expected: dict[str, tuple[int, ...]], available: dict[str, tuple[int, ...]]) -> KeyReport:
    """Compare the tensors a module needs with those a file holds (ignored prefixes skipped)."""
    relevant = {name for name in available if not name.startswith(IGNORED_PREFIXES)}
    return KeyReport(
        missing=sorted(set(expected) - relevant),
        unexpected=sorted(relevant - set(expected)),
        misshapen=sorted(
            f"{name} {list(available[name])} (expected {list(shape)})"
            for name, shape in expected.items()
            if name in available and tuple(available[name]) != tuple(shape)
        ),
    )


def module_shapes(module: nn.Module, prefix: str = "") -> dict[str, tuple[int, ...]]:
    return {prefix + name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}


@contextlib.contextmanager
def skipped_initialization():
    """Modules built only to be filled need no random init: on the meta device torch runs it through its
    Python reference ops, whose first use imports torch._dynamo (about 2 s of a bundle's load)."""
    names = [name for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")]
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def fill_module(
    module: nn.Module,
    tensors: Iterator[tuple[str, torch.Tensor]],
    *,
    dtype_of: Callable[[str], torch.dtype | None],
    device: torch.device,
    strict: bool = True,
) -> None:
    """Assign tensors (name relative to `module`) into a meta-device module.

    Each tensor is read from its memory map and converted on its own, so the weights exist once.
    """
    state = {}
    for name, tensor in tensors:
        dtype = dtype_of(name) if tensor.dtype != torch.int8 else None  # 8-bit weights stay 8-bit
        dtype = dtype or tensor.dtype  # None: as stored (e.g. a memory-mapped embedding table, never copied)
        state[name] = tensor.to(device=device, dtype=dtype)
    module.load_state_dict(state, strict=strict, assign=True)


class LayerWindow:
    """At most `size` decoder layers hold weights at once; the others wait on the meta device.

    A layer is filled from the tensor source when it is about to run, evicting the least recently run.
    """

    def __init__(self, size: int, tensors: TensorSource, *, dtype_of, device: torch.device):
        if size < 1:
            raise ValueError(f"resident layers must be at least 1, not {size}")
        self.size, self.tensors, self.dtype_of, self.device = size, tensors, dtype_of, device
        self.resident: OrderedDict[str, nn.Module] = OrderedDict()
        self.most_resident = 0  # the largest number of layers filled at once (for tests and reports)

    def enter(self, prefix: str, layer: nn.Module) -> None:
        if prefix in self.resident:
            self.resident.move_to_end(prefix)
            return
        while len(self.resident) >= self.size:
            self.resident.popitem(last=False)[1].to_empty(device="meta")  # frees the weights
        names = [name for name, _ in layer.state_dict().items()]
        fill_module(
            layer,
            ((name, self.tensors.get(prefix + name)) for name in names),
            dtype_of=lambda name: self.dtype_of(prefix.removeprefix(DECODER_PREFIX) + name),
            device=self.device,
        )
        self.resident[prefix] = layer
        self.most_resident = max(self.most_resident, len(self.resident))


class StreamedLayer(nn.Module):
    """A decoder layer that asks its window for its weights before it runs."""

    def __init__(self, layer: nn.Module, prefix: str, window: LayerWindow):
        super().__init__()
        self.layer, self.prefix = layer, prefix
        self.window = window  # shared by all layers (not a module: no state of its own)

    def forward(self, *args, **kwargs):
        self.window.enter(self.prefix, self.layer)
        return self.layer(*args, **kwargs)


def config_fingerprint(config: dict) -> str:
    """SHA-256 of the canonical JSON of a config (what /health reports)."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


# ------------------------------------------------------------------------------------------------
# A release, loaded


HIGH_PRECISION_DECODER_PARAMETERS = ("A_log", "dt_bias")  # kept in fp32 whatever the compute dtype


def decoder_dtype_of(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a decoder parameter is held in: fp32 for the DeltaNet decay parameters and int8 scales (at least)."""
    last = name.rsplit(".", 1)[-1]
    if (last in HIGH_PRECISION_DECODER_PARAMETERS or last.endswith(SCALE_SUFFIX)) and compute_dtype != torch.float64:
        return torch.float32
    return compute_dtype


@dataclass
class Release:
    """The parts of a release the runtime uses, ready on `device`."""

    root: Path | None  # None when built from tensors in memory
    config: dict  # config.json as read
    decoder: nn.Module  # Qwen35Decoder
    head: nn.Module  # JointHead (fp32)
    lm_head: torch.Tensor  # [V, D] output embeddings, as stored (rows gathered by the head)
    tokenizer: "Tokenizer"

    @property
    def fingerprint(self) -> str:
        return config_fingerprint(self.config)


class TensorSource(Protocol):
    """Named tensors by name: safetensors files, a bundle, or tensors drawn on demand (testing)."""

    def keys(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def get(self, name: str) -> torch.Tensor: ...


def load_release(
    root: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None = None,
    resident_layers: int | None = None,
) -> Release:
    """Strictly load the decoder, output embeddings, head and tokenizer of a release directory.

    `quantization` (an int8 mode): the decoder projections are quantized while loading, tensor by tensor.
    """
    from .tokenizer import Tokenizer

    config = read_json(root / "config.json")
    head_config = read_json(root / HEAD_CONFIG)
    tokenizer = Tokenizer.from_file(root / "tokenizer.json")
    if not (root / HEAD_WEIGHTS).is_file():
        raise ModelSourceError(f"{root} is not a Clef release: {HEAD_WEIGHTS} is missing")
    return build_release(
        config,
        head_config,
        tokenizer,
        QuantizingSource(SafetensorsFiles.of_release(root)) if quantization else SafetensorsFiles.of_release(root),
        SafetensorsFiles([root / HEAD_WEIGHTS]),
        device=device,
        dtype=dtype,
        root=root,
        quantization=quantization,
        resident_layers=resident_layers,
    )


def build_release(
    config: dict,
    head_config: dict,
    tokenizer: "Tokenizer",
    tensors: TensorSource,
    head_tensors: TensorSource,
    *,
    device: torch.device,
    dtype: torch.dtype,
    root: Path | None = None,
    quantization: str | None = None,
    resident_layers: int | None = None,
) -> Release:
    """Build the modules on the meta device, check every name and shape, and fill them from the sources.

    `resident_layers` (low-memory mode): decoder layers stay unfilled and at most that many hold their
    weights at once, each filled from the (memory-mapped) source just before it runs (`LayerWindow`).

    `dtype` is the compute dtype. With `quantization` (an int8 mode) the decoder's projections are
    `Int8Linear`s filled from a source that holds int8 weights and their scales (a bundle, or a
    `QuantizingSource`), and the input embeddings keep their stored 16-bit dtype: rows are gathered
    from the (memory-mapped) table and cast to `dtype`.
    """
    from .model.config import TextConfig
    from .model.joint_head import HeadConfig, JointHead
    from .model.qwen3_5 import Qwen35Decoder

    where = root if root is not None else "the model"
    try:
        text_config = TextConfig.from_release_config(config)
        parsed_head_config = HeadConfig.from_dict(head_config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelSourceError(f"{where}: unsupported or malformed config: {exc}") from exc
    if parsed_head_config.hidden_size != text_config.hidden_size:
        raise ModelSourceError(
            f"{where}: the head reads hidden size {parsed_head_config.hidden_size}, "
            f"the decoder has {text_config.hidden_size}"
        )

    with torch.device("meta"), skipped_initialization():
        decoder = Qwen35Decoder(text_config)
        head = JointHead(parsed_head_config)
    if quantization:
        replace_linears(decoder, quantization)
        decoder.activation_dtype = dtype
    expected = module_shapes(decoder, DECODER_PREFIX)
    expected[LM_HEAD] = (text_config.vocab_size, text_config.hidden_size)
    available = {name: tensors.shape(name) for name in tensors.keys()}
    check_keys(expected, available).raise_if_any(f"{where} (model*.safetensors)")

    def dtype_of(name: str) -> torch.dtype | None:
        return None if quantization and name == EMBEDDING else decoder_dtype_of(name, dtype)

    names = [name[len(DECODER_PREFIX) :] for name in expected if name != LM_HEAD]
    if resident_layers:
        window = LayerWindow(resident_layers, tensors, dtype_of=dtype_of, device=device)
        for index, layer in enumerate(decoder.layers):
            decoder.layers[index] = StreamedLayer(layer, f"{DECODER_PREFIX}layers.{index}.", window)
        names = [name for name in names if not name.startswith("layers.")]
    fill_module(
        decoder,
        ((name, tensors.get(DECODER_PREFIX + name)) for name in names),
        dtype_of=dtype_of,
        device=device,
        strict=not resident_layers,
    )
    lm_head = tensors.get(LM_HEAD).to(device)

    check_keys(module_shapes(head), {name: head_tensors.shape(name) for name in head_tensors.keys()}).raise_if_any(
        f"{where} ({HEAD_WEIGHTS})"
    )
    fill_module(
        head,
        ((name, head_tensors.get(name)) for name in module_shapes(head)),
        dtype_of=lambda name: torch.float32,  # the head is small: always fp32
        device=device,
    )
    return Release(
        root=root, config=config, decoder=decoder.eval(), head=head.eval(), lm_head=lm_head, tokenizer=tokenizer
    )
