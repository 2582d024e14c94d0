"""Strict loading: build the modules on the meta device, check every name and shape, fill them by name.

`build_model(checkpoint, plan)` is the one way a model is made, whatever the source
(release, hub download, bundle, random tensors). A tensor the model needs that is missing, one we do
not know, or one of the wrong shape is an error that lists them, sorted. Only the vision tower
(`model.visual.*`) and the multi-token-prediction layers (`mtp.*`) are skipped, by name. Each tensor is
read from its memory map and converted on its own, so loading never holds two copies of the weights.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import ModelSourceError
from ..errors import WeightsError
from .names import DECODER_PREFIX, IGNORED_PREFIXES, LM_HEAD, VISION_PREFIX
from .quant import Fp8QuantizingSource, QuantizingSource, pack_int8, replace_linears, unpack_int8
from .safetensors_io import TensorSource, release_pages
from .w8a8 import INT_MM

if TYPE_CHECKING:
    from ..model.config import TextConfig
    from ..plan import Plan
    from .sources import Checkpoint



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


def check_keys(
    expected: dict[str, tuple[int, ...]], available: dict[str, tuple[int, ...]], ignored: tuple[str, ...] = IGNORED_PREFIXES
) -> KeyReport:
    """Compare the tensors a module needs with those a file holds (`ignored` prefixes skipped)."""
    relevant = {name for name in available if not name.startswith(ignored)}
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


class _SkipMetaInit(TorchFunctionMode):
    """In-place ops on meta tensors do nothing: modules built only to be filled need no random init.

    On the meta device torch would run `nn.init` through its Python reference ops, whose first use
    imports torch._dynamo (about 2 s of a bundle's load). A torch-function mode is thread-local:
    nothing global is patched.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else kwargs.get("tensor")
        if name.endswith("_") and not name.startswith("_") and getattr(target, "is_meta", False):
            return target  # nn.init's uniform_, normal_, zeros_, ...: nothing to initialize on meta
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_modules() -> Iterator[None]:
    """Build modules on the meta device without random initialization."""
    with torch.device("meta"), _SkipMetaInit():
        yield


def fill_module(
    module: nn.Module,
    tensors: Iterator[tuple[str, torch.Tensor]],
    *,
    dtype_of: Callable[[str, torch.dtype], torch.dtype],
    device: torch.device,
    strict: bool = True,
) -> None:
    """Assign tensors (name relative to `module`) into a meta-device module, each converted on its own.

    A tensor converted to a copy gives its file pages back as it goes (memory-mapped sources: they would
    stay resident beside the copy); one held as it is stays a view of its file until `empty_module`."""
    state = {}
    for name, tensor in tensors:
        state[name] = tensor.to(device=device, dtype=dtype_of(name, tensor.dtype))
        if state[name] is not tensor:
            release_pages(tensor)
    module.load_state_dict(state, strict=strict, assign=True)


def empty_module(module: nn.Module) -> None:
    """Free a filled module's weights (back to the meta device), giving back the file pages of those that
    view a memory map."""
    for tensor in module.state_dict().values():
        release_pages(tensor)
    unpack_int8(module)
    module.to_empty(device="meta")


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
            empty_module(self.resident.popitem(last=False)[1])
        relative = prefix.removeprefix(DECODER_PREFIX)
        fill_module(
            layer,
            ((name, self.tensors.get(prefix + name)) for name in layer.state_dict()),
            dtype_of=lambda name, stored: self.dtype_of(relative + name, stored),
            device=self.device,
        )
        pack_int8(layer)
        self.resident[prefix] = layer
        self.most_resident = max(self.most_resident, len(self.resident))

    def clear(self) -> None:
        """Free every resident layer's weights."""
        while self.resident:
            empty_module(self.resident.popitem(last=False)[1])


class StreamedLayer(nn.Module):
    """A decoder layer that asks its window for its weights before it runs."""

    def __init__(self, layer: nn.Module, prefix: str, window: LayerWindow):
        super().__init__()
        self.layer, self.prefix = layer, prefix
        self.window = window  # shared by all layers (not a module: no state of its own)

    def forward(self, *args, **kwargs):
        self.window.enter(self.prefix, self.layer)
        return self.layer(*args, **kwargs)


@dataclass
class ModelParts:
    """The modules a checkpoint fills, ready on a device."""

    decoder: nn.Module  # Qwen35Decoder
    head: nn.Module  # JointHead (fp32)
    lm_head: torch.Tensor  # [V, D] output embeddings, as stored (rows gathered by the head)
    vision: nn.Module | None = None  # VisionTower (model.visual.*); None: the source has no tower (text only)


def build_model(checkpoint: Checkpoint, plan: Plan, *, resident_layers: int | None = None) -> ModelParts:
    """Build the modules on the meta device, check every name and shape, and fill them from the checkpoint.

    With an int8 precision the decoder's projections are `Int8Linear`s, filled from a source that holds
    int8 weights and their scales (a bundle), or from the checkpoint quantized tensor by tensor while
    loading (`QuantizingSource`); with fp8 `Fp8Linear`s, from a release quantized while loading. `resident_layers` (low-memory mode): at most that many decoder layers
    hold their weights at once, each filled from the (memory-mapped) source just before it runs.
    The `plan` (plan.py) says everything else: the precision, the W8A8 kernel, the device. Whatever a forward
    needs is made here (the int8 weights packed for their kernel), so the first answer takes a warm one's time.
    """
    precision, device = plan.precision, plan.device
    from ..model.joint_head import HeadConfig, JointHead
    from ..model.qwen3_5 import Qwen35Decoder

    where = checkpoint.where
    text_config = text_config_of(checkpoint)
    try:
        head_config = HeadConfig.from_dict(checkpoint.head_config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelSourceError(f"{where}: unsupported or malformed config: {exc}") from exc
    if head_config.hidden_size != text_config.hidden_size:
        raise ModelSourceError(
            f"{where}: the head reads hidden size {head_config.hidden_size}, the decoder has {text_config.hidden_size}"
        )
    tensors = checkpoint.tensors
    if precision.quantized and not checkpoint.stored_int8:
        tensors = QuantizingSource(tensors) if precision.int8 else Fp8QuantizingSource(tensors)

    with meta_modules():
        decoder = Qwen35Decoder(text_config)
        head = JointHead(head_config)
    if precision.quantized:
        replace_linears(decoder, precision.int8_mode, kernel=plan.kernel or INT_MM)
        decoder.activation_dtype = precision.compute_dtype
    names = checked_decoder_names(checkpoint, tensors, decoder)
    if resident_layers:
        window = LayerWindow(resident_layers, tensors, dtype_of=precision.dtype_of, device=device)
        for index, layer in enumerate(decoder.layers):
            decoder.layers[index] = StreamedLayer(layer, f"{DECODER_PREFIX}layers.{index}.", window)
        names = [name for name in names if not name.startswith("layers.")]
    fill_module(
        decoder,
        ((name, tensors.get(DECODER_PREFIX + name)) for name in names),
        dtype_of=precision.dtype_of,
        device=device,
        strict=not resident_layers,
    )
    pack_int8(decoder, device=device)  # (streamed layers: each when its window fills it)
    stored_lm_head = tensors.get(LM_HEAD)
    lm_head = stored_lm_head.to(device=device, dtype=precision.lm_head_dtype(stored_lm_head.dtype))

    head_tensors = checkpoint.head_tensors
    head_available = {name: head_tensors.shape(name) for name in head_tensors.keys()}
    check_keys(module_shapes(head), head_available).raise_if_any(f"{where} (joint_head.safetensors)")
    fill_module(
        head,
        ((name, head_tensors.get(name)) for name in module_shapes(head)),
        dtype_of=precision.head_dtype_of,
        device=device,
    )
    vision = build_vision(checkpoint, checkpoint.tensors, precision=precision, device=device)
    return ModelParts(decoder=decoder.eval(), head=head.eval(), lm_head=lm_head, vision=vision)


def text_config_of(checkpoint: Checkpoint) -> TextConfig:
    """The decoder's config, read from the checkpoint's config.json (a clear error when it is not one we run)."""
    from ..model.config import TextConfig

    try:
        return TextConfig.from_release_config(checkpoint.config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelSourceError(f"{checkpoint.where}: unsupported or malformed config: {exc}") from exc


def checked_decoder_names(checkpoint: Checkpoint, tensors: TensorSource, decoder: nn.Module) -> list[str]:
    """The names (relative to the decoder) of the tensors `decoder` is filled with, after checking every name
    and shape `tensors` holds against it and the output embeddings (strict; no data read)."""
    config = decoder.config
    expected = module_shapes(decoder, DECODER_PREFIX)
    expected[LM_HEAD] = (config.vocab_size, config.hidden_size)
    available = {name: tensors.shape(name) for name in tensors.keys()}
    check_keys(expected, available).raise_if_any(f"{checkpoint.where} ({checkpoint.decoder_files})")
    return [name[len(DECODER_PREFIX) :] for name in expected if name != LM_HEAD]


def build_vision(checkpoint: Checkpoint, tensors: TensorSource, *, precision, device: torch.device) -> nn.Module | None:
    """The vision tower from `model.visual.*`, strictly by name, when the source has one and an image processor;
    in `precision.vision_dtype` (the float precision's dtype; as released under int8)."""
    if checkpoint.processor_config is None or "vision_config" not in checkpoint.config:
        return None
    if not any(name.startswith(VISION_PREFIX) for name in tensors.keys()):
        return None
    from ..model.vision import VisionConfig, VisionTower

    try:
        config = VisionConfig.from_release_config(checkpoint.config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelSourceError(f"{checkpoint.where}: unsupported or malformed vision_config: {exc}") from exc
    with meta_modules():
        tower = VisionTower(config)
    expected = module_shapes(tower, VISION_PREFIX)
    available = {name: tensors.shape(name) for name in tensors.keys() if name.startswith(VISION_PREFIX)}
    check_keys(expected, available, ignored=()).raise_if_any(f"{checkpoint.where} ({checkpoint.decoder_files}, the vision tower)")
    fill_module(
        tower,
        ((name[len(VISION_PREFIX) :], tensors.get(name)) for name in expected),
        dtype_of=lambda name, stored: precision.vision_dtype(stored),
        device=device,
    )
    return tower.eval()
