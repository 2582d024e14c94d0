"""LoRA adapters beside one base decoder: many fine-tunes, one copy of the base, an adapter per record.

    bank = attach_adapters(decoder, adapters, default=NAME)   wrap the targeted projections (weights kept apart)
    merge_adapter(decoder, adapter)                           or fold one adapter into 16/32-bit weights
    with bank.route(row_slots, counts, width): decoder(...)   which adapter each row of a step takes

A wrapped projection computes `base(x) + (x A^T) B^T * scale` per adapter group, as PEFT's LoRA layer does (in
the adapter's fp32, added to the base's output): the base may be any linear of the plan (`nn.Linear`, or an int8
one of checkpoint/quant.py, which takes the unrotated input). Records of a step are grouped by adapter inside
each projection (gather the group's tokens, two thin products, scatter-add), as multi-LoRA servers do; a step
of one adapter (or of the base) takes no gather at all.

The projections see a step's tokens in three layouts (model/qwen3_5.py): `[B, L, I]`, the real tokens of a
padded step flat `[N, I]` (`project`, and the MLP), and the MLP's chunks of `MLP_ROWS` of either; the routing
holds each layout's groups, and `RoutedMLP` names the chunk it runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InferenceError
from .qwen3_5 import MLP, MLP_ROWS

BASE = -1  # the slot of "no adapter"
# (slot, the layout's flat rows it holds: a slice when they are contiguous, else their indices; None: every row)
Groups = list[tuple[int, "slice | torch.Tensor | None"]]


@dataclass(frozen=True)
class LoraPair:
    """One projection's low-rank update: `down` A [r, in], `up` B [out, r] (fp32, as trained), `scale`."""

    down: torch.Tensor
    up: torch.Tensor
    scale: float

    def delta(self) -> torch.Tensor:
        """The update of the projection's weight, `scale * B A` [out, in] in fp32 (what merging adds)."""
        return (self.up @ self.down) * self.scale

    @property
    def nbytes(self) -> int:
        return self.down.nbytes + self.up.nbytes

    def to(self, device: torch.device) -> LoraPair:
        return LoraPair(self.down.to(device), self.up.to(device), self.scale)


def token_groups(token_slots: torch.Tensor) -> Groups:
    """Group a layout's rows by adapter slot (the base's rows need nothing); computed on the host once per step.
    Each adapter's rows in one run (the torch backend orders a forward's records by adapter) are a slice: no
    gather, no scatter."""
    if token_slots.numel() == 0:
        return []
    first = int(token_slots[0])
    if bool((token_slots == first).all()):
        return [] if first == BASE else [(first, None)]
    starts = torch.cat((torch.zeros(1, dtype=torch.long), (token_slots[1:] != token_slots[:-1]).nonzero().squeeze(1) + 1))
    run_slots = token_slots[starts].tolist()
    if len(set(run_slots)) == len(run_slots):  # one run per adapter
        stops = starts[1:].tolist() + [token_slots.numel()]
        return [(slot, slice(start, stop)) for slot, start, stop in zip(run_slots, starts.tolist(), stops) if slot != BASE]
    return [(int(slot), (token_slots == slot).nonzero().squeeze(1)) for slot in token_slots.unique().tolist() if slot != BASE]


@dataclass
class Routing:
    """Which adapter each token of the current decoder step goes through."""

    rows: int  # B
    width: int  # L
    full: torch.Tensor  # [B * L] slot of every position of [B, L]
    real: torch.Tensor  # [N] slot of every real token, in row order (a padded step's flat layout)

    def __post_init__(self) -> None:
        self._groups: dict[str, Groups] = {}
        self.window: Groups | None = None  # set by RoutedMLP for one chunk

    def groups(self, layout: str) -> Groups:
        if layout not in self._groups:
            self._groups[layout] = token_groups(getattr(self, layout))
        return self._groups[layout]

    def layout_of(self, rows: int) -> str:
        """The flat layout of `rows` rows: all positions, or the real tokens of a padded step."""
        if rows == self.rows * self.width:
            return "full"
        if rows == self.real.numel():
            return "real"
        raise InferenceError(f"a routed projection got {rows} rows in a step of {self.rows} x {self.width} ({self.real.numel()} real)")


class AdapterBank:
    """The adapters kept apart beside one base: their names and slots, and the routing of the step at hand.

    The routing lives on the bank (not on a thread): one model worker runs a decoder at a time."""

    def __init__(self, adapters: Sequence[Any], default: str | None):
        """`adapters`: checkpoint.adapters.AdapterCheckpoint (a `name` and `pairs`: projection name -> LoraPair)."""
        self.adapters = list(adapters)
        self.slots = {adapter.name: slot for slot, adapter in enumerate(self.adapters)}
        self.default = BASE if default is None else self.slots[default]
        self.routing: Routing | None = None

    def slot_of(self, name: str | None) -> int:
        return BASE if name is None else self.slots[name]

    @contextlib.contextmanager
    def route(self, row_slots: Sequence[int], counts: Sequence[int], width: int) -> Iterator[None]:
        """Within the block, row b of the decoder's steps (`counts[b]` real tokens of `width`) takes adapter
        `row_slots[b]` (BASE: none)."""
        slots = torch.tensor(list(row_slots), dtype=torch.long)
        previous = self.routing
        self.routing = Routing(
            len(slots), width, slots.repeat_interleave(width), slots.repeat_interleave(torch.tensor(list(counts), dtype=torch.long))
        )
        try:
            yield
        finally:
            self.routing = previous

    def groups(self, x: torch.Tensor) -> Groups:
        """The adapter groups of a projection's input [B, L, I] or [M, I] under the current routing (none: every
        token takes the default adapter)."""
        routing = self.routing
        if routing is None:
            return [] if self.default == BASE else [(self.default, None)]
        if routing.window is not None:
            return routing.window
        if x.dim() == 3:
            if x.shape[0] != routing.rows:
                raise InferenceError(f"a routed projection got {x.shape[0]} rows in a step of {routing.rows}")
            return routing.groups("full")
        return routing.groups(routing.layout_of(x.shape[0]))


class LoraLinear(nn.Module):
    """A projection with LoRA updates kept apart from its weight: `base(x) + (x A^T) B^T * scale`, the adapter
    chosen per token group by the bank's routing."""

    def __init__(self, base: nn.Module, bank: AdapterBank):
        super().__init__()
        self.base = base
        self.bank = bank
        self.pairs: dict[int, LoraPair] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, index in self.bank.groups(x):
            pair = self.pairs.get(slot)
            if pair is None:  # this adapter does not train this projection
                continue
            if index is None:  # PEFT's order: result + lora_B(lora_A(x)) * scaling
                y = y + (F.linear(F.linear(x.to(pair.down.dtype), pair.down), pair.up) * pair.scale).to(y.dtype)
                continue
            flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])  # [M, I], [M, O] (views when contiguous)
            if isinstance(index, slice):
                flat_y[index] += (F.linear(F.linear(flat_x[index].to(pair.down.dtype), pair.down), pair.up) * pair.scale).to(y.dtype)
            else:
                index = index.to(flat_x.device)  # (the routing is built on the host)
                rows = flat_x.index_select(0, index).to(pair.down.dtype)
                flat_y.index_add_(0, index, (F.linear(F.linear(rows, pair.down), pair.up) * pair.scale).to(y.dtype))
            y = flat_y.view(y.shape)
        return y

    def extra_repr(self) -> str:
        return f"adapters={sorted(self.pairs)}"


class RoutedMLP(MLP):
    """The decoder's MLP whose chunks (MLP_ROWS rows at a time) tell the routed projections which tokens they hold."""

    def __init__(self, mlp: MLP, bank: AdapterBank):
        nn.Module.__init__(self)
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.bank = bank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        routing = self.bank.routing
        if flat.shape[0] <= MLP_ROWS or not x.is_cpu or routing is None:
            return super().forward(x)
        slots = getattr(routing, routing.layout_of(flat.shape[0]))
        pieces = []
        try:
            for start in range(0, flat.shape[0], MLP_ROWS):
                routing.window = token_groups(slots[start : start + MLP_ROWS])
                pieces.append(self._rows(flat[start : start + MLP_ROWS]))
        finally:
            routing.window = None
        return torch.cat(pieces).view(x.shape)


def projection_shapes(decoder: nn.Module) -> dict[str, tuple[int, int]]:
    """The decoder's linear projections, decoder-relative name -> (out, in) (any linear of the plan)."""
    shapes = {}
    for name, module in decoder.named_modules():
        if isinstance(module, LoraLinear):
            module = module.base
        if isinstance(module, nn.Linear) or hasattr(module, "weight_scale"):
            weight = module.weight
            shapes[name.removesuffix(".base")] = (int(weight.shape[0]), int(weight.shape[1]))
    return shapes


def attach_adapters(decoder: nn.Module, adapters: Sequence[Any], default: str | None, device: torch.device | None = None) -> AdapterBank:
    """Wrap every projection any of `adapters` trains in a LoraLinear (the base weights untouched; the updates on
    `device`) and every MLP in a RoutedMLP; the returned bank routes each step."""
    bank = AdapterBank(adapters, default)
    wrapped: dict[str, LoraLinear] = {}
    for slot, adapter in enumerate(adapters):
        for name, pair in adapter.pairs.items():
            if name not in wrapped:
                parent_name, _, child = name.rpartition(".")
                parent = decoder.get_submodule(parent_name)
                wrapped[name] = LoraLinear(getattr(parent, child), bank)
                setattr(parent, child, wrapped[name])
            wrapped[name].pairs[slot] = pair if device is None else pair.to(device)
    for name, module in list(decoder.named_modules()):
        if type(module) is MLP:
            parent_name, _, child = name.rpartition(".")
            setattr(decoder.get_submodule(parent_name), child, RoutedMLP(module, bank))
    return bank


@torch.no_grad()
def merge_adapter(decoder: nn.Module, adapter: Any) -> None:
    """Fold `adapter` into the decoder's 16/32-bit weights: W + scale * B A, added in fp32 and stored in W's dtype
    (as PEFT's merge_and_unload)."""
    for name, pair in adapter.pairs.items():
        module = decoder.get_submodule(name)
        if not isinstance(module, nn.Linear):
            raise InferenceError(f"{name} is a {type(module).__name__}: an adapter merges into 16/32-bit weights only")
        weight = module.weight
        weight.copy_((weight.float() + pair.delta().to(weight.device)).to(weight.dtype))
