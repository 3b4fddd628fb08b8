"""The norms of both model families."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm (Llama, T5): statistics in float32, no mean subtraction, no bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


def build_norm(norm_type: str, hidden_size: int, eps: float) -> nn.Module:
    return RMSNorm(hidden_size, eps) if norm_type == "rmsnorm" else nn.LayerNorm(hidden_size, eps=eps)
