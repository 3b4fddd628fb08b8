"""`hf_ppmoe.parallel.clip_grad_norm_` takes torch's arguments and gives torch's result on unsplit parameters (the
split layouts are held by the training equivalence tests)."""

import math

import pytest
import torch

from hf_ppmoe.parallel import clip_grad_norm_


def grads(seed):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    return params


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_equals_torch_on_plain_tensors(max_norm):
    ours, theirs = grads(0), grads(0)
    total = clip_grad_norm_(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    torch.testing.assert_close(total, expected)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)


def test_single_tensor_infinite_max_norm_and_norm_type():
    p = grads(1)[0]
    before = p.grad.clone()
    total = clip_grad_norm_(p, math.inf)
    torch.testing.assert_close(total, before.norm())
    assert torch.equal(p.grad, before)
    with pytest.raises(ValueError, match="2-norm only"):
        clip_grad_norm_(p, 1.0, norm_type=1.0)
