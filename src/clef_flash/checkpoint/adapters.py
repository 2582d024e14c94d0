"""clef-finetune's checkpoints, read as they are: a PEFT LoRA adapter on the decoder and a retrained joint head.

A checkpoint directory (what `clef-finetune train` saves every `save_every` steps):

    adapter/adapter_config.json          PEFT's LoraConfig (r, lora_alpha, target_modules: a full-name regex)
    adapter/adapter_model.safetensors    base_model.model.<module>.lora_A.weight [r, in] and .lora_B.weight [out, r], fp32
    joint_head.safetensors               the whole head, fp32 (it replaces the base's)
    train_config.json                    the training run's settings (read for `describe` only)

A projection with an adapter computes `y = x W^T + (x A^T) B^T * scale`, scale = lora_alpha / r (/ sqrt(r) with
rsLoRA), as PEFT does. Loading is strict: an adapter trained on another base (a module we do not have, a shape
that differs, a target without weights), a missing head, or a PEFT option that changes the arithmetic (DoRA,
rank or alpha patterns, biases, ...) is refused with one line that says what and where; nothing loads in part.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import ModelSourceError, WeightsError
from ..model.lora import LoraPair
from .loading import check_keys
from .names import DECODER_PREFIX

CONFIG_FILE = "adapter/adapter_config.json"
WEIGHTS_FILE = "adapter/adapter_model.safetensors"
HEAD_FILE = "joint_head.safetensors"
TRAIN_CONFIG_FILE = "train_config.json"
PEFT_PREFIX = "base_model.model."  # PeftModel's prefix of the wrapped model's module names
WEIGHT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")

# adapter_config.json: the keys the arithmetic reads, the keys that only describe the run, and the values that
# leave every other key inert. A key outside the first two whose value is not inert changes what a projection
# computes (DoRA, patterns, biases, other targets): refused, by name.
READ_KEYS = {"peft_type", "r", "lora_alpha", "use_rslora", "target_modules"}
DESCRIPTIVE_KEYS = {
    "base_model_name_or_path", "revision", "auto_mapping", "peft_version", "task_type", "inference_mode",
    "lora_dropout",  # dropout is off at inference
    "megatron_core", "qalora_group_size",  # read only with megatron_config / use_qalora, which must be inert
}
INERT_VALUES: tuple[Any, ...] = (None, False, {}, [], "none", "")
# PEFT's initializations that start from A random, B zero (the trained weights are all that count); the others
# (PiSSA, OLoRA, LoftQ, EVA, CorDA, ...) also rewrite the base weights, which the adapter file does not hold.
PLAIN_INITS = (True, False, "gaussian")
NAMED_OPTIONS = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "rank_pattern": "a per-module rank (rank_pattern)",
    "alpha_pattern": "a per-module alpha (alpha_pattern)",
    "bias": "trained biases",
    "lora_bias": "trained LoRA biases",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "fan_in_fan_out": "transposed (Conv1D) weights",
    "layers_to_transform": "a layer subset (layers_to_transform)",
    "exclude_modules": "excluded modules (exclude_modules)",
    "target_parameters": "parameter targets (target_parameters)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
}


@dataclass(frozen=True)
class AdapterCheckpoint:
    """A clef-finetune checkpoint, checked against the base it will run on."""

    name: str
    where: Path
    rank: int
    alpha: float
    scale: float
    pairs: dict[str, LoraPair]  # decoder-relative projection name ("layers.0.mlp.gate_proj") -> its update
    head: dict[str, torch.Tensor]  # the joint head's tensors (fp32), replacing the base's
    fingerprint: str  # sha256 over the three files
    train_config: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """The adapter's own bytes in memory: its LoRA pairs and its head."""
        return sum(pair.nbytes for pair in self.pairs.values()) + sum(tensor.nbytes for tensor in self.head.values())

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.where),
            "rank": self.rank,
            "alpha": self.alpha,
            "projections": len(self.pairs),
            "bytes": self.nbytes,
            "fingerprint": self.fingerprint[:16],
        }


def read_adapter(
    path: str | Path,
    *,
    name: str,
    projections: Mapping[str, tuple[int, int]],
    head_shapes: Mapping[str, tuple[int, ...]],
) -> AdapterCheckpoint:
    """Read and check the checkpoint at `path` for a base whose decoder has `projections` (decoder-relative
    linear names -> (out, in)) and whose head has `head_shapes`; raise ModelSourceError / WeightsError with one
    line when it does not fit."""
    root = Path(path).expanduser()
    where = f"adapter {name!r} ({root})"
    if not root.is_dir():
        raise ModelSourceError(f"{where}: not a directory (a clef-finetune checkpoint: adapter/ and {HEAD_FILE})")
    for required in (CONFIG_FILE, WEIGHTS_FILE, HEAD_FILE):
        if not (root / required).is_file():
            what = "the retrained joint head" if required == HEAD_FILE else "the PEFT adapter"
            raise ModelSourceError(f"{where}: {required} is missing ({what}); is this a clef-finetune checkpoint-N directory?")
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"{where}: {CONFIG_FILE} is not JSON: {exc}") from exc
    rank, alpha, scale = lora_arithmetic(config, where)
    targets = targeted(config.get("target_modules"), projections, where)
    pairs = read_pairs(root / WEIGHTS_FILE, where, rank=rank, scale=scale, projections=projections, targets=targets)
    head = read_head(root / HEAD_FILE, where, head_shapes)
    train_config = {}
    if (root / TRAIN_CONFIG_FILE).is_file():
        try:
            train_config = json.loads((root / TRAIN_CONFIG_FILE).read_text())
        except ValueError:
            train_config = {}
    digest = hashlib.sha256()
    for name_of_file in (CONFIG_FILE, WEIGHTS_FILE, HEAD_FILE):
        digest.update(name_of_file.encode() + b"\0" + (root / name_of_file).read_bytes())
    return AdapterCheckpoint(name, root, rank, alpha, scale, pairs, head, digest.hexdigest(), train_config)


def lora_arithmetic(config: Mapping[str, Any], where: str) -> tuple[int, float, float]:
    """(r, lora_alpha, scale) of a PEFT LoraConfig, after refusing every option that is not plain LoRA."""
    if config.get("peft_type") != "LORA":
        raise ModelSourceError(f"{where}: peft_type is {config.get('peft_type')!r}; clef-flash runs LoRA adapters only")
    for key in sorted(config):
        value = config[key]
        if key in READ_KEYS or key in DESCRIPTIVE_KEYS:
            continue
        if key == "init_lora_weights":
            if value not in PLAIN_INITS:
                raise ModelSourceError(
                    f"{where}: init_lora_weights={value!r} also rewrites the base weights, which the adapter does not hold; "
                    "clef-flash runs adapters initialized plainly (true, false or 'gaussian')"
                )
            continue
        if not any(value == inert and type(value) is type(inert) for inert in INERT_VALUES):
            what = NAMED_OPTIONS.get(key, "a PEFT option clef-flash does not run")
            raise ModelSourceError(f"{where}: adapter_config.json sets {key}={json.dumps(value)[:80]} ({what}); only plain LoRA is supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ModelSourceError(f"{where}: r must be a positive integer, not {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ModelSourceError(f"{where}: lora_alpha must be a number, not {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(alpha), scale


def targeted(target_modules: Any, projections: Mapping[str, tuple[int, int]], where: str) -> set[str]:
    """The decoder projections `target_modules` names, matched as PEFT matches them against the full model's
    module names: a string is a full-match regex, a list names suffixes."""
    full_names = {DECODER_PREFIX + name: name for name in projections}
    if isinstance(target_modules, str):
        try:
            pattern = re.compile(target_modules)
        except re.error as exc:
            raise ModelSourceError(f"{where}: target_modules is not a regex: {exc}") from exc
        chosen = {short for full, short in full_names.items() if pattern.fullmatch(full)}
    elif isinstance(target_modules, list) and all(isinstance(item, str) for item in target_modules):
        chosen = {short for full, short in full_names.items() if any(full == t or full.endswith("." + t) for t in target_modules)}
    else:
        raise ModelSourceError(f"{where}: target_modules must be a regex or a list of module names, not {target_modules!r}")
    if not chosen:
        raise ModelSourceError(f"{where}: target_modules names none of this base's decoder projections: trained on another base?")
    return chosen


def read_pairs(
    path: Path, where: str, *, rank: int, scale: float, projections: Mapping[str, tuple[int, int]], targets: set[str]
) -> dict[str, LoraPair]:
    """Every targeted projection's (A, B), strictly: missing, unexpected and misshapen keys listed, sorted."""
    expected: dict[str, tuple[int, ...]] = {}
    for short in targets:
        out_features, in_features = projections[short]
        full = PEFT_PREFIX + DECODER_PREFIX + short
        expected[f"{full}.lora_A.weight"] = (rank, in_features)
        expected[f"{full}.lora_B.weight"] = (out_features, rank)
    try:
        with safe_open(str(path), "pt") as handle:
            available = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
            check_keys(expected, available, ignored=()).raise_if_any(
                f"{where} ({WEIGHTS_FILE}; an adapter trained on another base?)"
            )
            tensors = {key: handle.get_tensor(key) for key in expected}
    except WeightsError:
        raise
    except Exception as exc:  # safetensors' own errors: a truncated or foreign file
        raise WeightsError(f"{where}: {WEIGHTS_FILE} cannot be read: {exc}") from exc
    pairs = {}
    for short in sorted(targets):
        full = PEFT_PREFIX + DECODER_PREFIX + short
        down, up = tensors[f"{full}.lora_A.weight"], tensors[f"{full}.lora_B.weight"]
        pairs[short] = LoraPair(down.float().contiguous(), up.float().contiguous(), scale)
    return pairs


def read_head(path: Path, where: str, head_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), "pt") as handle:
            available = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
            check_keys(dict(head_shapes), available, ignored=()).raise_if_any(f"{where} ({HEAD_FILE})")
            return {key: handle.get_tensor(key) for key in head_shapes}
    except WeightsError:
        raise
    except Exception as exc:
        raise WeightsError(f"{where}: {HEAD_FILE} cannot be read: {exc}") from exc


def parse_adapter_option(text: str) -> tuple[str | None, str]:
    """`--adapter` on the command line: "DIR" (answers by default) or "NAME=DIR" (chosen per request)."""
    name, sep, path = text.partition("=")
    if sep and name and "/" not in name and not Path(text).exists():
        return name, path
    return None, text


def adapter_name_of(path: str | Path) -> str:
    """The name an adapter given without one goes by: its checkpoint directory's, with its run's
    (`runs/tickets/checkpoint-400` -> "tickets/checkpoint-400")."""
    root = Path(path).expanduser().resolve()
    return f"{root.parent.name}/{root.name}" if root.name.startswith("checkpoint-") and root.parent.name else root.name


@dataclass
class LoadedAdapters:
    """The adapters a backend runs: by name, their heads (None: the base's), and how the decoder holds them."""

    adapters: dict[str, AdapterCheckpoint]
    heads: dict[str | None, torch.nn.Module]
    default: str | None  # what a request that names no adapter gets (None: the base)
    bank: Any = None  # model.lora.AdapterBank when the updates are kept apart
    merged: str | None = None  # the adapter folded into the weights (then the base itself is not served)

    def describe(self) -> list[dict[str, Any]]:
        mode = "merged into the weights" if self.merged else "kept apart (x A^T B^T * scale)"
        return [{**adapter.describe(), "default": name == self.default, "mode": mode} for name, adapter in self.adapters.items()]

    @property
    def serves_base(self) -> bool:
        return self.merged is None


def read_adapters(checkpoint: Any, paths: Mapping[str, str | Path]) -> dict[str, AdapterCheckpoint]:
    """Read and check every adapter in `paths` (name -> checkpoint directory) against `checkpoint`'s config, before
    the base is built (the modules on the meta device give the shapes)."""
    from ..model.joint_head import HeadConfig, JointHead
    from ..model.lora import projection_shapes
    from ..model.qwen3_5 import Qwen35Decoder
    from .loading import meta_modules, module_shapes, text_config_of

    with meta_modules():
        projections = projection_shapes(Qwen35Decoder(text_config_of(checkpoint)))
        head_shapes = module_shapes(JointHead(HeadConfig.from_dict(checkpoint.head_config)))
    return {name: read_adapter(path, name=name, projections=projections, head_shapes=head_shapes) for name, path in paths.items()}


def install_adapters(
    parts: Any, plan: Any, adapters: Mapping[str, AdapterCheckpoint], *, default: str | None, resident_layers: int | None = None
) -> LoadedAdapters:
    """Put `adapters` (read_adapters) in the built `parts` (checkpoint.ModelParts): one adapter that answers by
    default in a 16/32-bit plan is merged into the weights (the fastest; the base is then not served); otherwise
    the updates are kept apart, beside one copy of the base."""
    from ..model.joint_head import JointHead
    from ..model.lora import attach_adapters, merge_adapter
    from .loading import fill_module, meta_modules

    if resident_layers:
        raise ModelSourceError("adapters and resident_layers (the low-memory mode) do not combine: load the base whole")
    if default is not None and default not in adapters:
        raise ModelSourceError(f"the default adapter {default!r} is not among those given ({', '.join(adapters)})")
    adapters = dict(adapters)

    def head_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
        with meta_modules():
            head = JointHead(parts.head.config)
        fill_module(head, iter(tensors.items()), dtype_of=plan.precision.head_dtype_of, device=plan.device)
        return head.eval()

    heads: dict[str | None, torch.nn.Module] = {name: head_of(adapter.head) for name, adapter in adapters.items()}
    if len(adapters) == 1 and default is not None and not plan.precision.quantized:
        merge_adapter(parts.decoder, adapters[default])
        return LoadedAdapters(adapters, heads, default, merged=default)
    heads[None] = parts.head
    bank = attach_adapters(parts.decoder, list(adapters.values()), default, plan.device)
    return LoadedAdapters(adapters, heads, default, bank=bank)


def adapter_options(values: list[str] | None) -> dict[str, Any]:
    """The command line's `--adapter` values as `load`'s keywords: "DIR" answers by default (one at most),
    "NAME=DIR" answers the requests that name it."""
    options: dict[str, Any] = {}
    named: dict[str, str] = {}
    for value in values or ():
        name, path = parse_adapter_option(value)
        if name is None:
            if "adapter" in options:
                raise ModelSourceError(f"two --adapter DIR without a name ({options['adapter']}, {path}): name all but the default NAME=DIR")
            options["adapter"] = path
        elif name in named:
            raise ModelSourceError(f"two adapters named {name!r}")
        else:
            named[name] = path
    if named:
        options["adapters"] = named
    return options


def named_paths(options: dict[str, Any]) -> dict[str, str]:
    """`adapter_options`' keywords as one name -> directory map: the default adapter under its directory's name."""
    default = {adapter_name_of(options["adapter"]): options["adapter"]} if "adapter" in options else {}
    return {**default, **options.get("adapters", {})}


def side_by_side(values: list[str]) -> tuple[str, dict[str, str]]:
    """The one `--adapter` of a base-vs-tuned evaluation: (its name, `load`'s adapters=) — kept apart, so that
    the base answers too."""
    options = adapter_options(values)
    chosen = named_paths(options)
    if len(chosen) != 1:
        raise ModelSourceError(f"base vs tuned compares one adapter with the base; {len(chosen)} were given")
    (name,) = chosen
    return name, chosen
