"""Per-step balancing (hf_ppmoe.moe.balance): the bias update hand-worked; a step's micro-batches count as its whole
batch (1 vs 4 accumulation steps: the same biases, fractions, global-batch loss and router gradients); the bias is
saved and loaded with the model, the fractions with the balancer's state."""

import copy

import pytest
import torch
from helpers import tiny_gpt_config

from hf_ppmoe import GPTMoEForCausalLM
from hf_ppmoe.moe import LoadBalancer, MoELayer, bias_update
from hf_ppmoe.moe.losses import balance_loss


def test_bias_update_hand_worked():
    # load [3, 1, 0, 0], mean 1: sign(mean - load) = [-1, 0, 1, 1]; times 0.1, minus its mean 0.025
    delta = bias_update(torch.tensor([3.0, 1.0, 0.0, 0.0]), 0.1)
    torch.testing.assert_close(delta, torch.tensor([-0.125, -0.025, 0.075, 0.075]))
    assert bias_update(torch.full((4,), 2.0), 0.1).abs().sum() == 0  # balanced: nothing moves


def model_and_batches(seed=0, steps=3, micro=4, rows=2, **config):
    torch.manual_seed(seed)
    model = GPTMoEForCausalLM(tiny_gpt_config(num_hidden_layers=2, **config)).train()
    batches = torch.randint(3, 97, (steps, micro * rows, 9))
    return model, batches


def run_steps(model, batches, micro: int, lr: float = 0.0):
    """`steps` optimizer steps (plain SGD, mean over micro-batches), each over batches[step] cut into `micro`
    micro-batches, balancing after each. Returns per step the summed counts and per layer the aux losses' mean."""
    balancer = LoadBalancer(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    history = []
    for batch in batches:
        for part in batch.chunk(micro):
            out = model(part, labels=part)
            (out.loss / micro).backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append(balancer.step())
    balancer.remove()
    return history


@pytest.mark.parametrize("settings", [dict(router_expert_bias=True, router_bias_update_rate=0.05),
                                      dict(router_expert_bias=True, router_score_function="sigmoid", num_expert_groups=2, topk_expert_groups=1),
                                      dict(router_aux_loss_scope="global_batch")])
def test_four_micro_batches_update_as_one_batch(settings):
    """Counts are integers summed exactly: 4 accumulation steps give the very biases and fractions of one batch of
    the same rows (no optimizer update and dropless: the routes depend on nothing else; with a capacity factor the
    capacity is per forward, so the routes themselves differ)."""
    model, batches = model_and_batches(**settings)
    twin = copy.deepcopy(model)
    one, four = run_steps(model, batches, 1), run_steps(twin, batches, 4)
    for a, b in zip(one, four):
        assert torch.equal(a, b)
    for (name, buffer), (_, other) in zip(model.named_buffers(), twin.named_buffers()):
        assert torch.equal(buffer, other), name
    gates = [m.gate for m in model.modules() if isinstance(m, MoELayer)]
    if settings.get("router_expert_bias"):
        assert all(g.expert_bias.abs().sum() > 0 for g in gates)  # the bias moved
        assert all(abs(g.expert_bias.sum().item()) < 1e-6 for g in gates)  # centred
    else:
        # the fraction is what the last step's routes were: 1/k per route over the step's tokens
        E, K = model.config.num_experts, model.config.num_experts_per_tok
        for gate, counts in zip(gates, one[-1]):
            torch.testing.assert_close(gate.global_fraction, counts[:E] / K / counts[-1])
            assert gate.global_fraction.sum().item() == pytest.approx(1.0)


def test_global_batch_loss_and_router_gradient_equal_for_one_or_four_micro_batches():
    """After one step, the "global_batch" loss of a step is E * sum_e f_e m_e with f the last step's global fraction
    and m the mean probability over the step's tokens: 1 batch and 4 micro-batches (mean of their losses, gradients
    accumulated) give the same value and router gradients, and the value is the formula's."""
    model, batches = model_and_batches(router_aux_loss_scope="global_batch", steps=1)
    run_steps(model, batches, 1)  # sets the fractions
    twin = copy.deepcopy(model)
    batch = torch.randint(3, 97, (8, 9), generator=torch.Generator().manual_seed(4))
    whole = model(batch, labels=batch, output_router_logits=True)
    whole.aux_loss.backward()
    parts = [twin(part, labels=part) for part in batch.chunk(4)]
    for part in parts:
        (part.aux_loss / 4).backward()
    torch.testing.assert_close(torch.stack([p.aux_loss for p in parts]).mean(), whole.aux_loss)
    gates = [m.gate for m in model.modules() if isinstance(m, MoELayer)]
    for gate, other in zip(gates, [m.gate for m in twin.modules() if isinstance(m, MoELayer)]):
        torch.testing.assert_close(other.weight.grad, gate.weight.grad, rtol=1e-5, atol=1e-7)
    E = model.config.num_experts
    by_formula = torch.stack([
        balance_loss(logits.float().softmax(-1), gate.global_fraction.view(1, E), None, logits.shape[0])
        for gate, logits in zip(gates, whole.router_logits)
    ]).mean()
    torch.testing.assert_close(whole.aux_loss, by_formula)


def test_bias_saved_and_loaded_with_the_model_fractions_with_the_balancer(tmp_path):
    model, batches = model_and_batches(router_expert_bias=True, router_aux_loss_scope="global_batch", steps=2)
    run_steps(model, batches, 2)
    model.save_pretrained(tmp_path)
    loaded = GPTMoEForCausalLM.from_pretrained(tmp_path)
    for name, buffer in model.named_buffers():
        if name.endswith("expert_bias"):
            assert torch.equal(dict(loaded.named_buffers())[name], buffer)
    state = LoadBalancer(model).state_dict()
    assert state and all(key.endswith("global_fraction") for key in state)
    fresh = LoadBalancer(loaded)
    fresh.load_state_dict(state)
    for name, layer in fresh.layers.items():
        assert torch.equal(layer.gate.global_fraction, state[f"{name}.global_fraction"])
    # without either option there is nothing to balance and nothing in the checkpoint
    plain = GPTMoEForCausalLM(tiny_gpt_config())
    assert not LoadBalancer(plain).layers and LoadBalancer(plain).step() is None
    assert not any("expert_bias" in k or "global_fraction" in k for k in plain.state_dict())


def test_evaluation_forwards_do_not_count():
    model, batches = model_and_batches(router_expert_bias=True, steps=1)
    balancer = LoadBalancer(model)
    model.eval()
    model(batches[0], labels=batches[0])  # labels: losses and statistics computed, but not a training forward
    model.train()
    with torch.no_grad():
        model(batches[0])  # no statistics
    assert balancer.pending().abs().sum() == 0
