"""Declarative, reversible maps of weight names, and lazy tensor sources they apply to.

Legend: E experts, L layers, H hidden, I FFN inner size.

A `Rule` says which source tensors become which target tensors and how (an `Op`). In a name, `{i}` stands for every
layer (the rule is applied once per layer) and `{e}` for every expert (the op then receives or returns one tensor per
expert, in order). Every op has an exact inverse, so `mapping.inverse()` converts back and one table serves both
directions (as Transformers' `WeightConverter` and torchtitan's `to_hf`/`from_hf` do):

    Rule(("transformer.h.{i}.attn.c_attn.weight",),                      # GPT-2 Conv1D [H, 3H]
         ("model.layers.{i}.self_attn.q_proj.weight", ...k..., ...v...),  # three nn.Linear [H, H]
         Chain(Transpose(), Split(0, 3)))

A `TensorSource` is a read-only name -> tensor view. `mapping.apply(source)` returns another one, so maps compose and
nothing is computed until a tensor is asked for; `source.meta()` is the same view on meta tensors, which checks a
whole conversion (names and shapes) without reading or computing any weight.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch


class ConversionError(ValueError):
    """A checkpoint cannot be converted; the message names the tensors, files or settings at fault."""


def shape_str(t: torch.Tensor) -> str:
    return "[" + ", ".join(map(str, t.shape)) + "]"


# ----------------------------------------------------------------------------------------------------------- ops


class Op:
    """tensors -> tensors, with an exact inverse."""

    def __call__(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError

    def inverse(self) -> Op:
        raise NotImplementedError


@dataclass(frozen=True)
class Identity(Op):
    def __call__(self, xs):
        return list(xs)

    def inverse(self):
        return self


@dataclass(frozen=True)
class Transpose(Op):
    """Swap the last two dims: Conv1D [in, out] <-> nn.Linear [out, in] (GPT-2)."""

    def __call__(self, xs):
        return [x.transpose(-2, -1) for x in xs]

    def inverse(self):
        return self


@dataclass(frozen=True)
class Split(Op):
    """One tensor -> `parts` equal chunks along `dim` (a fused q/k/v, or gate/up).

    blocks > 1: the tensor is `blocks` equal blocks along `dim` and chunk r is the r-th piece of every block, joined
    (how tensor parallelism splits a fused [gate; up]: rank r holds [gate_r; up_r])."""

    dim: int
    parts: int
    blocks: int = 1

    def __call__(self, xs):
        (x,) = xs
        if x.shape[self.dim] % (self.parts * self.blocks):
            raise ConversionError(
                f"cannot split a tensor of shape {shape_str(x)} into {self.parts * self.blocks} equal parts along dim {self.dim}"
            )
        if self.blocks == 1:
            return list(x.chunk(self.parts, self.dim))
        pieces = [block.chunk(self.parts, self.dim) for block in x.chunk(self.blocks, self.dim)]
        return [torch.cat([p[r] for p in pieces], self.dim) for r in range(self.parts)]

    def inverse(self):
        return Concat(self.dim, self.parts, self.blocks)


@dataclass(frozen=True)
class Concat(Op):
    dim: int
    parts: int
    blocks: int = 1

    def __call__(self, xs):
        if self.blocks == 1:
            return [torch.cat(xs, self.dim)]
        pieces = [x.chunk(self.blocks, self.dim) for x in xs]
        return [torch.cat([p[b] for b in range(self.blocks) for p in pieces], self.dim)]

    def inverse(self):
        return Split(self.dim, self.parts, self.blocks)


@dataclass(frozen=True)
class Stack(Op):
    """`groups` runs of E per-expert tensors -> `groups` stacked [E, ...] tensors (Mixtral's experts.{e}.w1)."""

    groups: int = 1

    def __call__(self, xs):
        n = len(xs) // self.groups
        return [torch.stack(xs[g * n : (g + 1) * n]) for g in range(self.groups)]

    def inverse(self):
        return Unstack(self.groups)


@dataclass(frozen=True)
class Unstack(Op):
    groups: int = 1

    def __call__(self, xs):
        return [x_e for x in xs for x_e in x.unbind(0)]

    def inverse(self):
        return Stack(self.groups)


@dataclass(frozen=True)
class Copies(Op):
    """One tensor -> `n` copies of it (a tensor every tensor-parallel rank holds). Inverse: `Same`."""

    n: int
    label: str = "tensor"

    def __call__(self, xs):
        (x,) = xs
        return [x] * self.n

    def inverse(self):
        return Same(self.n, self.label)


@dataclass(frozen=True)
class Same(Op):
    """`n` tensors that must be equal -> one of them (T5's tied embedding copies, replicated tensor-parallel
    weights); unequal ones are an error, never a silent choice. Inverse: `Copies`."""

    n: int
    label: str = "tensor"

    def __call__(self, xs):
        for k, x in enumerate(xs[1:], 1):
            if x.shape != xs[0].shape or not (x.is_meta or torch.equal(x, xs[0])):  # values are checked when read
                raise ConversionError(f"{self.label} {k} differs from {self.label} 0; they must be equal copies")
        return [xs[0]]

    def inverse(self):
        return Copies(self.n, self.label)


@dataclass(frozen=True)
class PadRows(Op):
    """[rows, ...] -> [padded_rows, ...] with zero rows (Megatron pads its vocabulary to a multiple of 128 * TP).
    `crop`: the inverse, [>= rows, ...] -> its first `rows` rows."""

    rows: int
    padded_rows: int
    crop: bool = False

    def __call__(self, xs):
        (x,) = xs
        if self.crop:
            if x.shape[0] < self.rows:
                raise ConversionError(f"a vocabulary tensor of shape {shape_str(x)} has fewer than {self.rows} rows")
            return [x[: self.rows]]
        if x.shape[0] != self.rows:
            raise ConversionError(f"expected {self.rows} rows, got a tensor of shape {shape_str(x)}")
        return [torch.cat([x, x.new_zeros(self.padded_rows - self.rows, *x.shape[1:])])]

    def inverse(self):
        return PadRows(self.rows, self.padded_rows, not self.crop)


@dataclass(frozen=True)
class InterleaveQKV(Op):
    """q [nh*d, ...], k, v [ng*d, ...] -> qkv [ng*(nh/ng + 2)*d, ...]: per KV group g, its nh/ng q heads, then k_g,
    then v_g (Megatron's fused linear_qkv). `split`: the inverse."""

    heads: int
    groups: int
    head_dim: int
    split: bool = False

    def __call__(self, xs):
        g, r, d = self.groups, self.heads // self.groups, self.head_dim
        if not self.split:
            q, k, v = xs
            tail = q.shape[1:]
            qkv = torch.cat([q.reshape(g, r * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)], dim=1)
            return [qkv.reshape(g * (r + 2) * d, *tail)]
        (qkv,) = xs
        tail = qkv.shape[1:]
        if qkv.shape[0] != g * (r + 2) * d:
            raise ConversionError(f"{self.heads} heads in {g} groups make {g * (r + 2) * d} qkv rows, not {shape_str(qkv)}")
        q, k, v = qkv.reshape(g, (r + 2) * d, *tail).split([r * d, d, d], dim=1)
        return [q.reshape(g * r * d, *tail), k.reshape(g * d, *tail), v.reshape(g * d, *tail)]

    def inverse(self):
        return InterleaveQKV(self.heads, self.groups, self.head_dim, not self.split)


def _in_float64(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    # float64 keeps the round trip exact: E identical float32 copies average back to the same bits
    return fn(x.to(torch.float64)).to(x.dtype)


@dataclass(frozen=True)
class Scale(Op):
    factor: float

    def __call__(self, xs):
        if self.factor == 1.0:
            return list(xs)
        return [_in_float64(x, lambda v: v * self.factor) for x in xs]

    def inverse(self):
        return Scale(1.0 / self.factor)


@dataclass(frozen=True)
class Replicate(Op):
    """[...] -> [E, ...]: E copies of a dense weight (upcycling), plus N(0, noise_std^2) noise drawn from `seed`.

    Its inverse is `Merge(merge_weights)` (uniform by default): the weighted mean of the E experts."""

    num_experts: int
    noise_std: float = 0.0
    seed: int = 0
    merge_weights: tuple[float, ...] | None = None

    def __call__(self, xs):
        (x,) = xs
        out = x.unsqueeze(0).expand(self.num_experts, *x.shape)  # a view: materialized only when written
        if self.noise_std > 0 and not x.is_meta:
            generator = torch.Generator().manual_seed(self.seed)
            noise = torch.randn(out.shape, generator=generator, dtype=torch.float32) * self.noise_std
            out = (out.float() + noise.to(x.device)).to(x.dtype)
        return [out]

    def inverse(self):
        return Merge(self.merge_weights or (1.0 / self.num_experts,) * self.num_experts)


@dataclass(frozen=True)
class Slices(Op):
    """A dense FFN weight -> [g, ...]: its g equal slices along the inner dimension `dim`, stacked (fine-grained
    upcycling, arXiv 2410.07524: the g slices' outputs sum to the FFN's). `blocks` stacked parts ([gate; up]) are
    sliced alike: slice p is [gate_p; up_p]. dim None (a down-projection bias, which every slice's output adds): g
    copies of bias / g. `join`: the inverse, [g, ...] -> the slices joined (the biases summed)."""

    granularity: int
    dim: int | None
    blocks: int = 1
    join: bool = False

    def __call__(self, xs):
        (x,) = xs
        g = self.granularity
        if self.join and x.shape[0] != g:
            raise ConversionError(f"expected {g} slices, got a tensor of shape {shape_str(x)}")
        if self.dim is None:
            return [_in_float64(x, lambda v: v.sum(0))] if self.join else [
                _in_float64(x, lambda v: v / g).unsqueeze(0).expand(g, *x.shape)]
        if self.join:
            return Concat(self.dim, g, self.blocks)(list(x.unbind(0)))
        return [torch.stack(Split(self.dim, g, self.blocks)([x]))]

    def inverse(self):
        return Slices(self.granularity, self.dim, self.blocks, not self.join)


@dataclass(frozen=True)
class FlattenExperts(Op):
    """[C, g, ...] -> [C * g, ...]: C copies of g slices as C * g experts, expert e = slice e % g of copy e // g.
    `unflatten`: the inverse."""

    granularity: int
    unflatten: bool = False

    def __call__(self, xs):
        (x,) = xs
        if not self.unflatten:
            return [x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])]
        if x.shape[0] % self.granularity:
            raise ConversionError(f"{x.shape[0]} experts are not copies of {self.granularity} slices each")
        return [x.reshape(x.shape[0] // self.granularity, self.granularity, *x.shape[1:])]

    def inverse(self):
        return FlattenExperts(self.granularity, not self.unflatten)


@dataclass(frozen=True)
class Merge(Op):
    """[E, ...] -> [...]: sum_e weights[e] * x[e] in float64 (a one-hot weight picks that expert's exact bits)."""

    weights: tuple[float, ...]

    def __call__(self, xs):
        (x,) = xs
        if x.shape[0] != len(self.weights):
            raise ConversionError(f"expected {len(self.weights)} experts, got a tensor of shape {shape_str(x)}")
        nonzero = [e for e, w in enumerate(self.weights) if w != 0]
        if len(nonzero) == 1 and self.weights[nonzero[0]] == 1.0:
            return [x[nonzero[0]]]
        total = torch.zeros(x.shape[1:], dtype=torch.float64, device=x.device)
        for e in nonzero:  # one expert at a time in float64: memory of two experts, not of all E
            total += self.weights[e] * x[e].to(torch.float64)
        return [total.to(x.dtype)]

    def inverse(self):
        return Replicate(len(self.weights), merge_weights=self.weights)


@dataclass(frozen=True)
class Create(Op):
    """() -> a new tensor (a router's initial weights). Its inverse drops that tensor."""

    make: Callable[[], torch.Tensor] = field(compare=False)

    def __call__(self, xs):
        return [self.make()]

    def inverse(self):
        return Drop(self)


@dataclass(frozen=True)
class Drop(Op):
    """A tensor the target has no place for (a router when merging experts); inverse: the op that created it."""

    origin: Op

    def __call__(self, xs):
        return []

    def inverse(self):
        return self.origin


@dataclass(frozen=True)
class Chain(Op):
    ops: tuple[Op, ...]

    def __init__(self, *ops: Op):
        object.__setattr__(self, "ops", ops)

    def __call__(self, xs):
        for op in self.ops:
            xs = op(xs)
        return xs

    def inverse(self):
        return Chain(*(op.inverse() for op in reversed(self.ops)))


# ------------------------------------------------------------------------------------------------- rules, maps


@dataclass(frozen=True)
class Rule:
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    op: Op = Identity()

    def inverse(self) -> Rule:
        return Rule(self.targets, self.sources, self.op.inverse())


def rename(source: str, target: str, op: Op = Identity()) -> Rule:
    return Rule((source,), (target,), op)


@dataclass(frozen=True)
class Instance:
    """A rule with its layer filled in: concrete source and target names."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    op: Op


class Mapping:
    """A table of rules for a model of `num_layers` layers and `num_experts` experts.

    passthrough: source tensors no rule consumes are kept under their own name (else they are an error).
    ignore: regular expressions for source tensors that hold no weights (old buffers such as GPT-2's `attn.bias`).
    """

    def __init__(
        self,
        rules: Iterable[Rule],
        *,
        num_layers: int = 0,
        num_experts: int = 0,
        passthrough: bool = False,
        ignore: Iterable[str] = (),
    ):
        self.rules = list(rules)
        self.num_layers, self.num_experts = num_layers, num_experts
        self.passthrough = passthrough
        self.ignore = tuple(ignore)

    def inverse(self, ignore: Iterable[str] = ()) -> Mapping:
        return Mapping(
            [r.inverse() for r in self.rules],
            num_layers=self.num_layers,
            num_experts=self.num_experts,
            passthrough=self.passthrough,
            ignore=ignore,
        )

    def _expand(self, names: tuple[str, ...], layer: int | None) -> tuple[str, ...]:
        out = []
        for name in names:
            if layer is not None:
                name = name.replace("{i}", str(layer))
            if "{e}" in name:
                out.extend(name.replace("{e}", str(e)) for e in range(self.num_experts))
            else:
                out.append(name)
        return tuple(out)

    def instances(self) -> list[Instance]:
        result = []
        for rule in self.rules:
            per_layer = any("{i}" in n for n in rule.sources + rule.targets)
            for layer in range(self.num_layers) if per_layer else [None]:
                result.append(Instance(self._expand(rule.sources, layer), self._expand(rule.targets, layer), rule.op))
        return result

    def ignored(self, name: str) -> bool:
        return any(re.search(pattern, name) for pattern in self.ignore)

    def apply(self, source: TensorSource) -> MappedSource:
        return MappedSource(source, self)


# --------------------------------------------------------------------------------------------------- sources


class TensorSource:
    """A read-only, lazy name -> tensor view."""

    def keys(self) -> list[str]:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def meta(self) -> TensorSource:
        """The same view on meta tensors (shapes and dtypes only)."""
        raise NotImplementedError

    def origin(self, name: str) -> list[str]:
        """The tensors of the original checkpoint that `name` is computed from."""
        return [name]

    def describe(self, name: str) -> str:
        return name


def materialize(source: TensorSource) -> dict[str, torch.Tensor]:
    """Every tensor of `source`, computed (for conversions of in-memory state dicts)."""
    return {name: source.get(name) for name in source.keys()}


class DictSource(TensorSource):
    def __init__(self, tensors: dict[str, torch.Tensor], where: str = "the model"):
        self.tensors, self.where = tensors, where

    def keys(self):
        return list(self.tensors)

    def get(self, name):
        return self.tensors[name]

    def meta(self):
        return DictSource({k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in self.tensors.items()}, self.where)

    def describe(self, name):
        return f"{name} {shape_str(self.tensors[name])} in {self.where}"


class MappedSource(TensorSource):
    """`mapping` applied to `source`, lazily. Building it checks names: a tensor the mapping needs but the source lacks,
    or a source tensor the mapping has no place for, raises `ConversionError` naming them."""

    def __init__(self, source: TensorSource, mapping: Mapping):
        self.source, self.mapping = source, mapping
        available = source.keys()
        available_set = set(available)
        self._instances = mapping.instances()
        self._producer: dict[str, int] = {}
        consumed = set()
        missing = []
        for k, inst in enumerate(self._instances):
            missing += [s for s in inst.sources if s not in available_set]
            consumed.update(inst.sources)
            for t in inst.targets:
                self._producer[t] = k
        if missing:
            raise ConversionError(
                f"{len(missing)} tensor(s) are missing from the source checkpoint: {', '.join(missing[:8])}"
                + (" ..." if len(missing) > 8 else "")
                + ". The checkpoint is incomplete or does not match its config.json."
            )
        leftovers = [k for k in available if k not in consumed and not mapping.ignored(k)]
        if leftovers and not mapping.passthrough:
            raise ConversionError(
                f"The source checkpoint has {len(leftovers)} tensor(s) that this conversion has no place for: "
                f"{', '.join(leftovers[:8])}" + (" ..." if len(leftovers) > 8 else "")
                + ". They would be lost; the checkpoint does not match its config.json or holds extra modules."
            )
        self._passthrough = set(leftovers)
        self._keys = [t for inst in self._instances for t in inst.targets] + leftovers
        self._cache: tuple[int, list[torch.Tensor]] | None = None

    def keys(self):
        return list(self._keys)

    def get(self, name):
        if name in self._passthrough:
            return self.source.get(name)
        k = self._producer[name]
        if self._cache is None or self._cache[0] != k:
            inst = self._instances[k]
            inputs = [self.source.get(s) for s in inst.sources]
            try:
                outputs = inst.op(inputs)
            except (RuntimeError, ValueError) as err:
                sources = ", ".join(self.source.describe(s) for s in inst.sources)
                raise ConversionError(f"cannot convert {sources} into {', '.join(inst.targets)}: {err}") from err
            self._cache = (k, outputs)
        inst = self._instances[k]
        return self._cache[1][inst.targets.index(name)]

    def meta(self):
        return MappedSource(self.source.meta(), self.mapping)

    def origin(self, name):
        if name in self._passthrough:
            return self.source.origin(name)
        return [o for s in self._instances[self._producer[name]].sources for o in self.source.origin(s)]

    def describe(self, name):
        return ", ".join(self._root_describe(o) for o in self.origin(name)) or f"{name} (created)"

    def _root_describe(self, name):
        source = self.source
        while isinstance(source, MappedSource):
            source = source.source
        return source.describe(name)
