"""Dispatch implementations agree; MoE layers reduce to the dense FFN where they must."""

import copy

import pytest
import torch
from helpers import GPT2_STYLE, tiny_gpt_config

from hf_ppmoe.moe import MLP, MoELayer

GATE_SETTINGS = [
    dict(router_type="topk", num_experts_per_tok=2),
    dict(router_type="topk", num_experts_per_tok=2, capacity_factor=0.5),
    dict(router_type="switch", num_experts_per_tok=1, capacity_factor=1.0, router_jitter_noise=0.1),
    dict(router_type="gshard", num_experts_per_tok=2, capacity_factor=1.0, router_num_groups=2),
    dict(router_type="prototype", num_experts_per_tok=2, capacity_factor=0.75),
]
MLP_STYLES = [dict(), dict(gated_mlp=False, hidden_act="gelu_new", mlp_bias=True)]


def run(layer, x, seed=0):
    """Forward + backward with a fixed seed (so jitter / random routing draw the same numbers)."""
    layer.zero_grad()
    torch.manual_seed(seed)
    x = x.clone().requires_grad_(True)
    y, routing = layer(x)
    (y.square().sum() + routing.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return y.detach(), x.grad, grads, routing


@pytest.mark.parametrize("mlp", MLP_STYLES, ids=["gated", "plain_bias"])
@pytest.mark.parametrize("gate", GATE_SETTINGS, ids=lambda g: f"{g['router_type']}-cf{g.get('capacity_factor')}")
@pytest.mark.parametrize("other", ["einsum", "grouped_mm", "batched_mm"])
def test_experts_implementations_agree(gate, mlp, other):
    config = tiny_gpt_config(num_experts=4, **gate, **mlp)
    layer = MoELayer(config).train()
    x = torch.randn(3, 8, 32)
    y_ref, gx_ref, g_ref, routing = run(layer, x)
    if gate.get("capacity_factor"):
        assert routing.dropped_fraction > 0, "the case should exercise dropped routes"
    layer.experts.config._experts_implementation = other
    y, gx, grads, _ = run(layer, x)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx, gx_ref, atol=1e-5, rtol=1e-5)
    for name in g_ref:
        torch.testing.assert_close(grads[name], g_ref[name], atol=1e-5, rtol=1e-5, msg=name)


def copy_dense_into_experts(layer, dense, scale=1.0):
    """Every expert := the dense FFN (scaled on the output side)."""
    E = layer.experts.num_experts
    with torch.no_grad():
        if layer.experts.has_gate:
            w_in = torch.cat([dense.gate_proj.weight, dense.up_proj.weight])
        else:
            w_in = dense.up_proj.weight
        layer.experts.in_proj.copy_(w_in.expand(E, -1, -1))
        layer.experts.down_proj.copy_((dense.down_proj.weight * scale).expand(E, -1, -1))
        if layer.experts.has_bias:
            b_in = torch.cat([dense.gate_proj.bias, dense.up_proj.bias]) if layer.experts.has_gate else dense.up_proj.bias
            layer.experts.in_proj_bias.copy_(b_in.expand(E, -1))
            layer.experts.down_proj_bias.copy_((dense.down_proj.bias * scale).expand(E, -1))


@pytest.mark.parametrize("mlp", MLP_STYLES, ids=["gated", "plain_bias"])
def test_one_expert_moe_equals_dense_ffn(mlp):
    config = tiny_gpt_config(num_experts=1, num_experts_per_tok=1, router_type="switch", **mlp)
    layer, dense = MoELayer(config), MLP(config)
    copy_dense_into_experts(layer, dense)
    x = torch.randn(2, 6, 32)
    y, routing = layer(x)
    torch.testing.assert_close(routing.weights, torch.ones(12, 1))  # softmax over a single expert
    torch.testing.assert_close(y, dense(x))


@pytest.mark.parametrize("mlp", MLP_STYLES, ids=["gated", "plain_bias"])
@pytest.mark.parametrize(
    "gate",
    [dict(router_type="topk", num_experts_per_tok=2), dict(router_type="gshard", num_experts_per_tok=2)],
    ids=["topk", "gshard"],
)
def test_identical_experts_with_normalised_weights_equal_dense(gate, mlp):
    config = tiny_gpt_config(num_experts=4, **gate, **mlp)
    layer, dense = MoELayer(config).eval(), MLP(config)
    copy_dense_into_experts(layer, dense)
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(layer(x)[0], dense(x), atol=1e-6, rtol=1e-5)


def test_shared_expert_is_added():
    config = tiny_gpt_config(shared_expert_intermediate_size=16)
    layer = MoELayer(config)
    x = torch.randn(2, 3, 32)
    y, _ = layer(x)
    no_shared = copy.deepcopy(layer)
    no_shared.shared_expert = None
    torch.testing.assert_close(y, no_shared(x)[0] + layer.shared_expert(x))


def test_dropped_token_output_is_zero_and_gradient_free():
    config = tiny_gpt_config(**GPT2_STYLE, num_experts=2, num_experts_per_tok=1, router_type="switch", capacity_factor=0.5)
    layer = MoELayer(config).train()
    x = torch.randn(1, 8, 32, requires_grad=True)
    y, routing = layer(x)
    dropped = (routing.expert_ids == 2).squeeze(1)
    assert dropped.any()
    assert (y[0, dropped] == 0).all()
    y.sum().backward()
    # a dropped token still receives router gradients only through the aux loss, not through the experts
    assert x.grad is not None


@pytest.mark.parametrize("mlp", MLP_STYLES, ids=["gated", "plain_bias"])
@pytest.mark.parametrize(
    "tokens,k", [(1, 2), (1, 1), (2, 1), (3, 2), (8, 2), (40, 2)], ids=lambda v: str(v)
)
def test_decoding_path_equals_training_path(tokens, k, mlp):
    """Few routes without gradients take the host-grouped path (one or two routes: per row from the stored weights;
    more: grouped matmuls); it must give the training path's numbers, padding (no route at all) included."""
    gate = dict(router_type="switch") if k == 1 else {}
    config = tiny_gpt_config(num_experts=4, num_experts_per_tok=k, capacity_factor=0.5, eval_capacity_factor=0.5,
                             **gate, **mlp)
    layer = MoELayer(config).eval()
    x = torch.randn(tokens, 32)
    for token_mask in (None, torch.arange(tokens) > 0):  # the second: the first token is padding
        reference, routing = layer(x, token_mask)  # gradients enabled: the sorted path
        with torch.no_grad():
            fast, _ = layer(x, token_mask, compute_losses=False)
        if tokens >= 8:
            assert (routing.expert_ids == 4).any(), "the case should exercise dropped routes"
        torch.testing.assert_close(fast, reference.detach(), atol=1e-6, rtol=1e-5)
    assert (fast[0] == 0).all()


@pytest.mark.parametrize("mlp", MLP_STYLES, ids=["gated", "plain_bias"])
@pytest.mark.parametrize("tokens", [1, 24])
def test_index_dispatch_under_bf16_autocast_equals_explicit_bf16(tokens, mlp):
    """Under autocast the experts compute in bf16 like nn.Linear would (training and decoding paths): the same numbers
    as the layer with bf16 weights and inputs, with float32 gradients for the float32 parameters."""
    config = tiny_gpt_config(num_experts=4, **mlp)
    layer = MoELayer(config).train()
    x = torch.randn(tokens, 32)
    routing = layer.gate(x)
    for grad in (False, True):  # decoding path, then training path
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer.experts(x, routing.expert_ids, routing.weights)
        reference = copy.deepcopy(layer.experts).to(torch.bfloat16)
        with torch.set_grad_enabled(grad):
            expected = reference(x.to(torch.bfloat16), routing.expert_ids, routing.weights.to(torch.bfloat16))
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, expected, atol=2e-2, rtol=2e-2)
    y.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in layer.experts.parameters())


def test_swiglu_written_out_backward_equals_autograd():
    """The experts' SwiGLU (`_SwiGLU`, a hand-written backward used in eager full precision) against autograd's
    derivative of silu(gate) * up, and against torch.autograd.gradcheck in float64."""
    from hf_ppmoe.moe.experts import _SwiGLU

    gate_up = torch.randn(37, 2 * 24, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(37, 24, dtype=torch.float64)
    (ours,) = torch.autograd.grad(_SwiGLU.apply(gate_up), gate_up, grad)
    gate, up = gate_up.chunk(2, dim=-1)
    (reference,) = torch.autograd.grad(torch.nn.functional.silu(gate) * up, gate_up, grad)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(_SwiGLU.apply, (gate_up[:5, :8].detach().requires_grad_(),))
