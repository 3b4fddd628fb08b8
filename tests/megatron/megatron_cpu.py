"""Test-only patches that let megatron-core 0.16.1 run GPTModel (local spec, MoE, TP/EP/PP schedules) on CPU + gloo.

Never imported by hf_ppmoe: only by the test launches (separate processes, so nothing leaks into other tests).
Each patch replaces a CUDA-only call with its CPU equivalent; none changes numerics. Pinned to the version they
were written against: `require_megatron_core()` skips with a message on any other version. Without each patch:

1  torch.cuda.current_device()        AssertionError "Torch not compiled with CUDA enabled" (GlobalMemoryBuffer in
                                      attention, TP gather buffers, router tensors, p2p shapes)
1b Tensor.cuda()                      same error: language_module.py moves tied output weights (PP > 1)
1c torch.cuda.synchronize()           same error after every pipeline send/recv (p2p_communication.py)
2  get_default_causal_mask / get_sliding_window_causal_mask  build their masks with device="cuda"
3  moe_utils.te_general_gemm          NameError: 0.16.1 reads this name, defined only when Transformer Engine imports
4  WrappedTorchNorm                   "sequence parallel not supported by torch LayerNorm": without apex/TE the torch
                                      norm refuses sequence parallelism, which megatron-core requires for MoE + TP in
                                      training; the replacement tags norm weights `sequence_parallel` like TE/apex do
5  CudaToCpuMode                      pipeline schedules allocate torch.zeros(..., device="cuda")
6  seed()                             model_parallel_cuda_manual_seed stores CUDA RNG states
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

MEGATRON_CORE_VERSION = "0.16.1"


def require_megatron_core() -> str | None:
    """None when the pinned megatron-core is importable, else why the Megatron tests cannot run."""
    try:
        from megatron.core import __version__
    except ImportError:
        return 'megatron-core is not installed (pip install -e ".[megatron]")'
    if __version__ != MEGATRON_CORE_VERSION:
        return f"the CPU patches are written for megatron-core {MEGATRON_CORE_VERSION}, found {__version__}"
    return None


def apply() -> None:
    reason = require_megatron_core()
    if reason:
        raise RuntimeError(reason)
    torch.cuda.current_device = lambda: torch.device("cpu")  # 1
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # 1b
    torch.cuda.synchronize = lambda *args, **kwargs: None  # 1c

    import megatron.core.fusions.fused_softmax as fused_softmax  # 2
    import megatron.core.transformer.utils as transformer_utils

    def causal_mask(sq):
        return torch.ones(sq, sq, dtype=torch.bool).triu(1)

    def sliding_window_mask(sq, skv, window_size):
        allowed = torch.ones(sq, skv, dtype=torch.bool).triu(skv - sq - window_size[0]).tril(skv - sq + window_size[1])
        return ~allowed

    fused_softmax.get_default_causal_mask = transformer_utils.get_default_causal_mask = causal_mask
    fused_softmax.get_sliding_window_causal_mask = sliding_window_mask

    import megatron.core.transformer.moe.moe_utils as moe_utils  # 3

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    from megatron.core.transformer import torch_norm  # 4

    def torch_norm_new(
        cls,
        config,
        hidden_size,
        eps=1e-5,
        persist_layer_norm=False,
        zero_centered_gamma=False,
        normalization="LayerNorm",
    ):
        norm = (torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm)(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = torch_norm_new


class CudaToCpuMode(TorchFunctionMode):
    """5: rewrites device="cuda..." arguments of torch calls to "cpu" (use around pipeline schedules)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def seed(value: int) -> None:
    """6: model_parallel_cuda_manual_seed with the inference RNG tracker, whose add/fork never touch CUDA (dropout
    inside tracker.fork() then draws from the CPU generator; the tests use no dropout)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(value)
    model_parallel_cuda_manual_seed(value, inference_rng_tracker=True, force_reset_rng=True)
