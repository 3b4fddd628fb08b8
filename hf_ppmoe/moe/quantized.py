"""Quantized expert weights: bitsandbytes' 4-bit (NF4 / FP4, block-wise absmax) and 8-bit (LLM.int8() row-wise)
storage, or a torchao tensor, behind the `Experts` module's stacked weights.

Legend: E experts, O output rows of one expert, I input columns.

A stacked weight `W [E, O, I]` (`gate_up_proj` / `up_proj`, `down_proj`; Transformers' Mixtral layout) is stored as
the matrix `[E * O, I]` a bitsandbytes `Linear4bit(I, E * O)` or `Linear8bitLt(I, E * O)` would hold: the same
`Params4bit` / `Int8Params`, quantized by the same functions (`quantize_4bit`, `int8_vectorwise_quant`), written to
a checkpoint under the same names (`weight`, `weight.absmax`, `weight.quant_map`, ...; `weight`, `SCB`) and read back
by Transformers' own bitsandbytes deserializers. Where O * I is a multiple of the block size (64), an expert's values
are whole blocks, so one expert dequantizes alone, bit for bit as the whole matrix does. torchao's storage is its own
tensor subclass of shape [E, O, I] (`ExpertsWeightTorchAo`).

The storage is a torch parametrization of the `Experts` module (`torch.nn.utils.parametrize`), as bitsandbytes' own
`replace_parameter_4bit` does for a parameter outside `nn.Linear`: `experts.gate_up_proj` still reads `[E, O, I]`,
dequantized on each read (once per forward pass in the experts' grouped kernels), so every experts implementation
runs unchanged. QLoRA stacks a `LowRankDelta` on top for each forward pass (hf_ppmoe.peft). `dequantize_expert(e)`
reads one expert alone (the batch-1 decoding path, `experts._one_expert`). The parametrized tensor's `original` is an
empty placeholder kept out of the state dict: the quantized tensors live in the parametrization module
(`experts.parametrizations.gate_up_proj.0.weight`, ...).

bitsandbytes and torchao are imported on first use: `import hf_ppmoe` needs neither.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils import parametrize


class QuantizedExpertsWeight(nn.Module):
    """One stacked expert weight `[E, O, I]`, quantized; the parametrization that dequantizes it when it is read."""

    bits: int = 0

    def __init__(self, shape: tuple[int, int, int]):
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, placeholder: torch.Tensor) -> torch.Tensor:
        """[E, O, I], dequantized (the parametrized tensor's empty `original` is not read)."""
        return self.dequantize().view(self.shape)

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def dequantize_expert(self, e: int) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"shape={self.shape}, bits={self.bits}"


class ExpertsWeight4bit(QuantizedExpertsWeight):
    """4-bit storage: `weight`, a bitsandbytes `Params4bit` packing the `[E * O, I]` matrix (two values a byte; one
    absmax per block of `blocksize` values, itself 8-bit quantized with `compress_statistics`)."""

    bits = 4

    def __init__(self, shape, quant_type: str = "nf4", compress_statistics: bool = False, quant_storage=torch.uint8,
                 blocksize: int | None = None):
        import bitsandbytes as bnb

        super().__init__(shape)
        E, O, I = self.shape
        # the packed form a checkpoint holds (two values a byte, viewed as quant_storage); quantize_ replaces it
        packed = (E * O * I + 1) // 2 // torch.empty(0, dtype=quant_storage).element_size()
        self.weight = bnb.nn.Params4bit(
            torch.empty(packed, 1, dtype=quant_storage, device="meta"),
            requires_grad=False,
            blocksize=blocksize,
            compress_statistics=compress_statistics,
            quant_type=quant_type,
            quant_storage=quant_storage,
            module=self,
        )
        self.quant_state = None  # where Params4bit's from_prequantized / quantization records it, as on Linear4bit

    def quantize_(self, value: torch.Tensor) -> None:
        """Quantize `value [E, O, I]` into `weight` on value's device (what Transformers does for a Linear4bit)."""
        import bitsandbytes as bnb

        settings = {k: v for k, v in self.weight.__dict__.items() if k != "quant_state"}
        self.weight = bnb.nn.Params4bit(value.reshape(-1, self.shape[-1]), requires_grad=False, **settings).to(value.device)

    def dequantize(self) -> torch.Tensor:
        return self._values(0, self.shape[0], self.shape)

    def dequantize_expert(self, e: int) -> torch.Tensor:
        """Expert e's `[O, I]`: its bytes and its blocks' scales only (when its values are whole blocks)."""
        E, O, I = self.shape
        if O * I % self.weight.quant_state.blocksize:  # blocks straddle experts: dequantize them all
            return self.dequantize()[e]
        return self._values(e, e + 1, (O, I))

    def _values(self, first: int, end: int, shape) -> torch.Tensor:
        """Experts first..end-1, dequantized by bitsandbytes' `dequantize_4bit`, as `shape`. The values are handed to
        it as rows of one block each (`quantize_4bit` cuts blocks from the flat values; bitsandbytes 0.50's CPU
        kernel reads a matrix's blocks row by row, so a [E * O, I] matrix whose I is not a multiple of the block size
        comes back wrong: checked in tests/moe/test_quantized.py)."""
        import bitsandbytes.functional as F

        state = self.weight.quant_state
        size, bs = math.prod(self.shape[1:]), state.blocksize
        n = (end - first) * size
        absmax = state.absmax
        if state.nested:  # as dequantize_4bit does it, for the whole matrix (one value a block)
            absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
        if (first, end) != (0, self.shape[0]):
            absmax = absmax[first * size // bs : end * size // bs]
        rows = (n // bs, bs) if n % bs == 0 else (1, n)
        flat = F.QuantState(absmax=absmax.float(), shape=torch.Size(rows), code=state.code, blocksize=bs,
                            quant_type=state.quant_type, dtype=state.dtype)
        packed = self.weight.data.view(torch.uint8).reshape(-1)[first * size // 2 : (end * size + 1) // 2]
        return F.dequantize_4bit(packed, flat).view(shape)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """`weight` and its quantization state as `weight.absmax`, `weight.quant_map`, ... (Linear4bit's names)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight.quant_state is not None:
            for k, v in self.weight.quant_state.as_dict(packed=True).items():
                destination[prefix + "weight." + k] = v if keep_vars else v.detach()


class ExpertsWeight8bit(QuantizedExpertsWeight):
    """8-bit storage: `weight`, a bitsandbytes `Int8Params` `[E * O, I]` (int8), and its row scales `SCB [E * O]`
    (`weight.SCB`, saved as `SCB`, Linear8bitLt's name)."""

    bits = 8

    def __init__(self, shape):
        import bitsandbytes as bnb

        super().__init__(shape)
        E, O, I = self.shape
        self.weight = bnb.nn.Int8Params(torch.empty(E * O, I, dtype=torch.int8, device="meta"), requires_grad=False)

    def quantize_(self, value: torch.Tensor) -> None:
        """Quantize `value [E, O, I]` into `weight` on value's device (bitsandbytes casts to float16 first)."""
        import bitsandbytes as bnb

        matrix = value.reshape(-1, self.shape[-1])
        self.weight = bnb.nn.Int8Params(matrix.to("cpu"), requires_grad=False).to(value.device)

    def dequantize(self) -> torch.Tensor:
        import bitsandbytes.functional as F

        return F.int8_vectorwise_dequant(self.weight.data, self.weight.SCB)

    def dequantize_expert(self, e: int) -> torch.Tensor:
        import bitsandbytes.functional as F

        O = self.shape[1]
        return F.int8_vectorwise_dequant(self.weight.data[e * O : (e + 1) * O], self.weight.SCB[e * O : (e + 1) * O])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight.SCB is not None:
            destination[prefix + "SCB"] = self.weight.SCB if keep_vars else self.weight.SCB.detach()


class LowRankDelta(nn.Module):
    """A parametrization stacked on quantized storage while LoRA is active: `W + scaling * B_e @ A_e` for every expert
    e, from the adapters' (lhs [E, O, r], rhs [E, r, I], scaling) factors, in W's dtype (one batched product each).
    The only parametrization allowed on top of quantized storage (`check_stacked`): hf_ppmoe.peft adds and removes
    it around each forward pass."""

    def __init__(self, factors: list[tuple[torch.Tensor, torch.Tensor, float]]):
        super().__init__()
        self.factors = factors

    def forward(self, W: torch.Tensor) -> torch.Tensor:
        for lhs, rhs, scaling in self.factors:
            W = torch.baddbmm(W, lhs.to(W.dtype), rhs.to(W.dtype), alpha=scaling)
        return W


def add_delta(experts: nn.Module, name: str, delta: LowRankDelta) -> None:
    parametrize.register_parametrization(experts, name, delta, unsafe=True)


def remove_delta(experts: nn.Module, name: str, delta: LowRankDelta) -> None:
    """Remove exactly `delta` from the parametrizations of `experts.<name>` (the whole parametrization where it was
    the only one, on full-precision weights)."""
    chain = experts.parametrizations[name]
    if len(chain) == 1:
        parametrize.remove_parametrizations(experts, name, leave_parametrized=False)
        return
    del chain[next(i for i, module in enumerate(chain) if module is delta)]


def check_stacked(experts: nn.Module, args) -> None:
    """Forward pre-hook of an experts module with quantized weights: refuse a parametrization stacked on the storage
    other than `LowRankDelta` (PEFT 0.21's own LoRA wrapper on a parametrized weight leaves its term behind after each
    forward pass, so it would be added again and again)."""
    for name, chain in (getattr(experts, "parametrizations", None) or {}).items():
        foreign = [type(m).__name__ for m in list(chain)[1:] if not isinstance(m, LowRankDelta)]
        if isinstance(chain[0], QuantizedExpertsWeight) and foreign:
            raise ValueError(
                f"{name} of these experts is stored quantized and carries {', '.join(foreign)}: PEFT's own wrapper does "
                "not remove its LoRA term from a quantized weight. Build the adapter with hf_ppmoe.peft.lora_config "
                "and load one with hf_ppmoe.peft.load_adapter (or dequantize the model first: model.dequantize())."
            )


class ExpertsWeightTorchAo(QuantizedExpertsWeight):
    """torchao storage: `weight`, a torchao tensor subclass of shape [E, O, I] made by torchao's `quantize_` with the
    config given (e.g. `Int8WeightOnlyConfig()`: int8 values, one scale a row of each expert), read back with its own
    `dequantize()`; Transformers' torchao serialization saves and loads it."""

    def __init__(self, shape, config):
        super().__init__(shape)
        self.config = config
        self.bits = type(config).__name__
        self.weight = nn.Parameter(torch.empty(self.shape, device="meta"), requires_grad=False)

    def quantize_(self, value: torch.Tensor) -> None:
        from torchao.quantization import FqnToConfig, quantize_

        self.weight = nn.Parameter(value, requires_grad=False)
        quantize_(self, FqnToConfig({"weight": self.config}), filter_fn=None)

    def dequantize(self) -> torch.Tensor:
        return self.weight.dequantize()

    def dequantize_expert(self, e: int) -> torch.Tensor:
        return self.weight[e].dequantize()


def quantized_weight(experts: nn.Module, name: str) -> QuantizedExpertsWeight | None:
    """The quantized storage of `experts.<name>`, when that is all its parametrization holds (no LoRA on top)."""
    if not parametrize.is_parametrized(experts, name):
        return None
    chain = experts.parametrizations[name]
    return chain[0] if len(chain) == 1 and isinstance(chain[0], QuantizedExpertsWeight) else None


def is_quantized(experts: nn.Module, name: str) -> bool:
    """Whether `experts.<name>` is stored quantized (a LoRA parametrization on top included)."""
    return parametrize.is_parametrized(experts, name) and isinstance(experts.parametrizations[name][0],
                                                                      QuantizedExpertsWeight)


def store_quantized(experts: nn.Module, name: str, storage: QuantizedExpertsWeight) -> None:
    """Make `storage` the parametrization of `experts.<name>` (the stacked parameter is dropped): reading the attribute
    dequantizes. The parametrized tensor's `original` is an empty buffer outside the state dict."""
    device = storage.weight.device
    del experts._parameters[name]
    experts.register_buffer(name, torch.empty(0, device=device), persistent=False)
    if not parametrize.is_parametrized(experts):
        experts.register_forward_pre_hook(check_stacked)
    parametrize.register_parametrization(experts, name, storage, unsafe=True)
    chain = experts.parametrizations[name]
    chain.register_buffer("original", chain.original, persistent=False)


def storage_for(shape, bits: int | None = None, torchao=None, **settings) -> QuantizedExpertsWeight:
    """Empty (meta) storage for a stacked weight of `shape`: bitsandbytes' 4 or 8 bits (with its 4-bit settings), or
    a torchao config."""
    if torchao is not None:
        return ExpertsWeightTorchAo(shape, torchao)
    if bits == 4:
        return ExpertsWeight4bit(shape, **settings)
    if bits == 8:
        return ExpertsWeight8bit(shape)
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def parameter_count(experts: nn.Module) -> int:
    """The number of weights of `experts`, a quantized matrix counted by its [E, O, I] shape (not its packed bytes)."""
    plain = sum(p.numel() for n, p in experts.named_parameters() if not n.startswith("parametrizations."))
    chains = (getattr(experts, "parametrizations", None) or {}).values()
    return plain + sum(math.prod(chain[0].shape) for chain in chains if isinstance(chain[0], QuantizedExpertsWeight))


def dequantize_experts(experts: nn.Module, dtype: torch.dtype | None = None) -> None:
    """Replace every quantized stacked weight of `experts` by a plain parameter holding its dequantized values (in
    `dtype`, else as dequantized): the model computes as before and LoRA merges into it."""
    if parametrize.is_parametrized(experts):
        # torch's deepcopy of a parametrized module shares the class torch made for it, and removing a
        # parametrization edits that class: give this module a class of its own, so that a copy stays as it is
        cls = type(experts)
        own = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
        experts.__class__ = type(cls.__name__, cls.__bases__, own)
    for name in list(getattr(experts, "parametrizations", {}) or {}):
        if not is_quantized(experts, name):
            continue
        values = experts.parametrizations[name][0](None).detach()
        parametrize.remove_parametrizations(experts, name, leave_parametrized=False)
        delattr(experts, name)
        experts.register_parameter(name, nn.Parameter(values.to(dtype or values.dtype), requires_grad=False))


__all__ = [
    "ExpertsWeight4bit",
    "ExpertsWeight8bit",
    "ExpertsWeightTorchAo",
    "LowRankDelta",
    "QuantizedExpertsWeight",
    "add_delta",
    "check_stacked",
    "dequantize_experts",
    "is_quantized",
    "parameter_count",
    "quantized_weight",
    "remove_delta",
    "storage_for",
    "store_quantized",
]
