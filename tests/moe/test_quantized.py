"""Quantized expert storage (hf_ppmoe.moe.quantized) against bitsandbytes itself: the stored bytes and scales are what
bitsandbytes' own quantization of the same [E * O, I] matrix gives, the dequantized experts are its dequantization
bit for bit (the whole stack and each expert alone), and an `Experts` module computes from quantized storage exactly
what it computes from those dequantized values as plain parameters, in every experts implementation."""

import copy

import pytest
import torch
from helpers import tiny_gpt_config

from hf_ppmoe.moe import Experts
from hf_ppmoe.moe.quantized import dequantize_experts, quantized_weight, storage_for, store_quantized

bnb = pytest.importorskip("bitsandbytes", reason="quantized experts need bitsandbytes (the test extra)")
F = bnb.functional

E = 4
SETTINGS = {
    "nf4": dict(bits=4, quant_type="nf4", compress_statistics=False),
    "nf4-double": dict(bits=4, quant_type="nf4", compress_statistics=True),
    "fp4": dict(bits=4, quant_type="fp4", compress_statistics=False),
    "int8": dict(bits=8),
}


def bnb_reference(W: torch.Tensor, settings: dict):
    """(stored tensor, its scales, dequantized [E*O, I]) by bitsandbytes on the [E*O, I] matrix: its quantization
    functions, and for 4-bit its portable dequantization (the default backend's, which its CPU backend also runs for
    odd sizes): its CPU kernel for `dequantize_4bit` reads the blocks of a matrix row by row, which is wrong where a
    row is not a whole number of blocks (`test_bitsandbytes_cpu_4bit_kernel_needs_whole_blocks_a_row`)."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    matrix = W.reshape(-1, W.shape[-1])
    if settings["bits"] == 8:
        CB, SCB, _ = F.int8_vectorwise_quant(matrix.half())
        return CB, SCB, F.int8_vectorwise_dequant(CB, SCB)
    packed, state = F.quantize_4bit(matrix, quant_type=settings["quant_type"],
                                    compress_statistics=settings["compress_statistics"])
    absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset if state.nested else state.absmax
    code = _get_4bit_code(state.quant_type, W.device)
    values = _dequantize_4bit_compute(packed.reshape(-1), absmax, code, state.blocksize, matrix.shape, matrix.dtype)
    if matrix.shape[-1] % state.blocksize == 0:  # where bitsandbytes' CPU kernel is right, it gives the same
        assert torch.equal(F.dequantize_4bit(packed, state), values)
    return packed, state.absmax, values


@pytest.mark.parametrize("shape", [(E, 96, 64), (E, 64, 96)], ids=["I=64", "I=96"])
@pytest.mark.parametrize("name", SETTINGS)
def test_storage_is_bitsandbytes_quantization_bit_for_bit(name, shape):
    torch.manual_seed(0)
    W = torch.randn(shape) * 0.02
    O, I = shape[1:]
    settings = SETTINGS[name]
    storage = storage_for(shape, **settings)
    storage.quantize_(W)
    stored, scales, dequantized = bnb_reference(W, settings)
    assert torch.equal(storage.weight.data, stored)
    assert torch.equal(storage.weight.SCB if settings["bits"] == 8 else storage.weight.quant_state.absmax, scales)
    assert torch.equal(storage(None), dequantized.view(shape))
    for e in range(E):
        assert torch.equal(storage.dequantize_expert(e), dequantized[e * O : (e + 1) * O])
    # bytes: 4-bit packs two values a byte; 8-bit one
    assert storage.weight.numel() * storage.weight.element_size() == W.numel() * settings["bits"] // 8


def test_bitsandbytes_cpu_4bit_kernel_needs_whole_blocks_a_row():
    """Why `ExpertsWeight4bit` hands bitsandbytes its values in rows of one block: bitsandbytes 0.50.2's CPU
    `dequantize_4bit` of a 256 x 96 matrix is far from the matrix (blocks of 64 read row by row), and right for
    256 x 64. When this fails, bitsandbytes has fixed its kernel and the note in docs/quantization.md can go."""
    torch.manual_seed(0)
    errors = {}
    for I in (64, 96):
        W = torch.randn(256, I)
        W.view(-1)[::64] *= 100  # one large value a block: a block read with another block's scale shows
        packed, state = F.quantize_4bit(W, quant_type="nf4")
        errors[I] = (F.dequantize_4bit(packed, state) - W).abs().max().item()
    assert errors[64] < 10 < 50 < errors[96], errors


@pytest.mark.parametrize("gated", [True, False])
def test_experts_compute_from_storage_what_they_compute_from_its_values(gated):
    """The stacked weights quantized (NF4, double-quantized), against the same module with their dequantized values as
    plain parameters: equal outputs, bit for bit, for the training path, decoding (one token, two routes: expert by
    expert), a no-grad batch, the einsum implementation, and the input gradient."""
    torch.manual_seed(0)
    config = tiny_gpt_config(hidden_size=64, intermediate_size=96, gated_mlp=gated, hidden_act="silu" if gated else "gelu",
                             mlp_bias=not gated)
    experts = Experts(config)
    quantized = copy.deepcopy(experts)
    for name in ("gate_up_proj" if gated else "up_proj", "down_proj"):
        storage = storage_for(tuple(getattr(experts, name).shape), **SETTINGS["nf4-double"])
        storage.quantize_(getattr(experts, name).detach())
        store_quantized(quantized, name, storage)
        assert quantized_weight(quantized, name) is storage and name not in dict(quantized.named_parameters())
    plain = copy.deepcopy(quantized)
    dequantize_experts(plain)
    assert not hasattr(plain, "parametrizations")

    def run(module, T, implementation="index", grad=True):
        module.config._experts_implementation = implementation
        gen = torch.Generator().manual_seed(T)
        x = torch.randn(T, 64, generator=gen, requires_grad=grad)
        ids = torch.randint(0, 4, (T, 2), generator=gen)
        weights = torch.rand(T, 2, generator=gen)
        with torch.set_grad_enabled(grad):
            out = module(x, ids, weights)
        if grad:
            out.square().sum().backward()
            return out, x.grad
        return (out,)

    for T, implementation, grad in [(12, "index", True), (1, "index", False), (9, "index", False), (12, "einsum", False)]:
        for a, b in zip(run(quantized, T, implementation, grad), run(plain, T, implementation, grad)):
            assert torch.equal(a, b), (T, implementation, grad)
