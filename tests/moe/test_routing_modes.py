"""Today's routing options, hand-worked: sigmoid scores with routed scaling, group-limited top-k (DeepSeek-V3), the
expert bias (chooses, never weighs), the balance-loss scopes, and router replay (given the normal routing's ids, it
is the normal routing: same routes, weights, losses and gradients)."""

import math

import pytest
import torch
from helpers import tiny_gpt_config

from hf_ppmoe import GPTMoEForCausalLM
from hf_ppmoe.moe import MoELayer, get_gate_class
from hf_ppmoe.moe.losses import balance_loss


def gate_of(router_type="topk", *, num_experts=4, top_k=2, **overrides):
    """A gate whose router weight is the identity: its logits are the hidden states we pass in."""
    config = tiny_gpt_config(hidden_size=num_experts, num_attention_heads=1, num_key_value_heads=1,
                             position_embedding_type="learned", num_experts=num_experts, num_experts_per_tok=top_k,
                             router_type=router_type, **overrides)
    gate = get_gate_class(router_type)(config)
    with torch.no_grad():
        gate.weight.copy_(torch.eye(num_experts))
    return gate


def logit(p):
    return math.log(p / (1 - p))


def test_sigmoid_scores_renormalised_and_scaled_hand_worked():
    # scores sigmoid(l) = [0.9, 0.2, 0.6, 0.1]: top-2 experts 0 and 2, weights 0.9 / 1.5 and 0.6 / 1.5, times 2.5
    gate = gate_of(router_score_function="sigmoid", routed_scaling_factor=2.5)
    r = gate(torch.tensor([[logit(0.9), logit(0.2), logit(0.6), logit(0.1)]]))
    assert r.expert_ids.tolist() == [[0, 2]]
    assert r.weights[0].tolist() == pytest.approx([2.5 * 0.6, 2.5 * 0.4], abs=1e-6)
    # the balance loss reads the scores normalised over all experts: m = s / 1.8, c/S = [1/2, 0, 1/2, 0]
    expected = 4 * (0.5 * 0.9 / 1.8 + 0.5 * 0.6 / 1.8)
    assert r.aux_loss.item() == pytest.approx(expected, abs=1e-6)
    unnormalised = gate_of(router_score_function="sigmoid", norm_topk_prob=False)(torch.tensor([[logit(0.9), 0.0, logit(0.6), -5.0]]))
    assert unnormalised.weights[0].tolist() == pytest.approx([0.9, 0.6], abs=1e-6)


def test_group_limited_topk_honours_the_best_groups_hand_worked():
    # 8 experts in 4 groups of 2; group score = sum of its two scores: [0.9+0.1, 0.5+0.45, 0.8+0.01, 0.3+0.3]
    # = [1.0, 0.95, 0.81, 0.6]. With topk_expert_groups=2 the experts come from groups 0 and 1: top-2 of
    # {0.9, 0.1, 0.5, 0.45} = experts 0 and 2, although expert 4 (0.8, group 2) scores higher than expert 2.
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.45, 0.8, 0.01, 0.3, 0.3]])
    gate = gate_of(num_experts=8, top_k=2, router_score_function="sigmoid", num_expert_groups=4, topk_expert_groups=2)
    r = gate(torch.logit(scores))
    assert r.expert_ids.tolist() == [[0, 2]]
    torch.testing.assert_close(r.weights[0], torch.tensor([0.9, 0.5]) / 1.4)
    # one group: expert 4 joins
    free = gate_of(num_experts=8, top_k=2, router_score_function="sigmoid", num_expert_groups=4, topk_expert_groups=4)
    assert free(torch.logit(scores)).expert_ids.tolist() == [[0, 4]]
    with pytest.raises(ValueError, match="num_expert_groups=3"):
        tiny_gpt_config(num_experts=8, num_expert_groups=3)
    with pytest.raises(ValueError, match="options of router_type='topk'"):
        tiny_gpt_config(router_type="gshard", router_score_function="sigmoid")


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_expert_bias_changes_the_choice_not_the_weights(score_function):
    gate = gate_of(router_expert_bias=True, router_score_function=score_function, norm_topk_prob=False)
    x = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    scores = x.softmax(-1) if score_function == "softmax" else x.sigmoid()
    assert gate(x).expert_ids.tolist() == [[0, 1]]
    with torch.no_grad():
        gate.expert_bias.copy_(torch.tensor([-1.0, 0.0, 0.0, 1.0]))  # expert 0 pushed out, expert 3 in
    r = gate(x)
    assert r.expert_ids.tolist() == [[3, 1]]
    torch.testing.assert_close(r.weights[0], scores[0, [3, 1]])  # the unbiased scores
    assert "expert_bias" in gate.state_dict() and not gate.expert_bias.requires_grad
    with pytest.raises(ValueError, match="router_expert_bias=True"):
        tiny_gpt_config(router_type="gshard", router_expert_bias=True)


def test_sequence_scope_is_the_mean_of_each_sequences_loss():
    """DeepSeek-V3's sequence-wise balance loss: computed per sequence (here 3 sequences of 5 tokens), then averaged."""
    torch.manual_seed(0)
    config = tiny_gpt_config(router_aux_loss_scope="sequence")
    layer = MoELayer(config)
    x = torch.randn(3, 5, config.hidden_size)
    _, routing = layer(x)
    micro = MoELayer(tiny_gpt_config())
    micro.load_state_dict(layer.state_dict())
    per_sequence = torch.stack([micro(x[b : b + 1])[1].aux_loss for b in range(3)])
    torch.testing.assert_close(routing.aux_loss, per_sequence.mean())
    # padding: a sequence's padded tokens count in none of its terms
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    _, padded = layer(x, mask)
    per_sequence = torch.stack([micro(x[b : b + 1][mask[b : b + 1]])[1].aux_loss for b in range(3)])
    torch.testing.assert_close(padded.aux_loss, per_sequence.mean())


def test_global_scope_uses_the_fraction_it_is_given_and_this_inputs_before():
    gate = gate_of(router_aux_loss_scope="global_batch").train()
    x = torch.tensor([[2.0, 1.0, 0.0, 0.0], [0.0, 2.0, 1.0, 0.0]])
    first = gate(x)  # no global fraction yet: this input's, as the micro-batch scope
    micro = gate_of()(x)
    torch.testing.assert_close(first.aux_loss, micro.aux_loss)
    torch.testing.assert_close(first.assigned_per_expert, torch.tensor([0.5, 1.0, 0.5, 0.0]))
    assert first.num_tokens.item() == 2
    # only this scope counts them (LoadBalancer sums them per step); the others spend no kernel on them
    assert micro.assigned_per_expert is None and micro.num_tokens is None
    with torch.no_grad():
        gate.global_fraction.copy_(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    expected = balance_loss(x.softmax(-1), gate.global_fraction.unsqueeze(0), None, 2)
    torch.testing.assert_close(gate(x).aux_loss, expected)


# ------------------------------------------------------------------------------------------------ router replay

REPLAY_GATES = {
    "topk": dict(router_type="topk", capacity_factor=1.0),
    "topk-m6t": dict(router_type="topk", topk_weighting="m6t"),
    "sigmoid-groups-bias": dict(router_type="topk", router_score_function="sigmoid", num_expert_groups=2,
                                topk_expert_groups=1, router_expert_bias=True, routed_scaling_factor=2.0),
    "switch": dict(router_type="switch", num_experts_per_tok=1, capacity_factor=1.0),
    "gshard": dict(router_type="gshard", capacity_factor=1.0, router_num_groups=2),
    "prototype": dict(router_type="prototype", capacity_factor=1.5),
}


@pytest.mark.parametrize("name", REPLAY_GATES)
def test_replay_of_the_normal_routes_is_the_normal_routing(name):
    """Given the ids the gate chose (before capacity and padding, as select() returns them), replay gives the same
    routes after capacity and padding, the same weights, losses and router-weight gradient. GShard in training draws
    its random routing: replay takes the recorded (possibly skipped) second routes as they are."""
    torch.manual_seed(1)
    config = tiny_gpt_config(num_experts=4, **{"num_experts_per_tok": 2, **REPLAY_GATES[name]})
    layer = MoELayer(config).train()
    if layer.gate.expert_bias is not None:
        with torch.no_grad():
            layer.gate.expert_bias.copy_(torch.tensor([0.3, -0.1, 0.0, -0.2]))
    x = torch.randn(2, 6, config.hidden_size)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    layer.gate.generator = torch.Generator().manual_seed(0)
    x_flat = x.reshape(-1, config.hidden_size)
    logits = layer.gate.gating(x_flat)
    layer.gate.generator = torch.Generator().manual_seed(0)
    selected, _, _ = layer.gate.select(logits)  # draws the same random numbers the forward below draws
    layer.gate.generator = torch.Generator().manual_seed(0)
    out, normal = layer(x, mask)
    layer.zero_grad()
    (out.square().sum() + normal.aux_loss).backward()
    grad = layer.gate.weight.grad.clone()

    layer.gate.generator = torch.Generator().manual_seed(5)  # replay draws nothing that matters
    layer.zero_grad()
    out2, replayed = layer(x, mask, expert_ids=selected)
    (out2.square().sum() + replayed.aux_loss).backward()
    assert torch.equal(replayed.expert_ids, normal.expert_ids)
    torch.testing.assert_close(replayed.weights, normal.weights)
    torch.testing.assert_close(out2, out)
    torch.testing.assert_close(replayed.aux_loss, normal.aux_loss)
    torch.testing.assert_close(layer.gate.weight.grad, grad)
    assert layer.gate.weight.grad.abs().sum() > 0


def test_replay_routes_by_other_ids_and_the_gate_weights_still_learn():
    torch.manual_seed(0)
    layer = MoELayer(tiny_gpt_config(num_experts=4, num_experts_per_tok=2)).train()
    x = torch.randn(5, 32)
    ids = torch.tensor([[3, 2], [1, 0], [2, 3], [0, 1], [1, 3]])
    out, routing = layer(x, expert_ids=ids)
    assert torch.equal(routing.expert_ids, ids)
    probs = layer.gate.gating(x).softmax(-1)
    chosen = probs.gather(1, ids)
    torch.testing.assert_close(routing.weights, chosen / chosen.sum(-1, keepdim=True))
    out.sum().backward()
    assert layer.gate.weight.grad.abs().sum() > 0


def test_model_replay_with_recorded_ids_equals_the_normal_forward():
    """The model's forward takes `router_expert_ids` as `output_router_logits` returns them. Dropless (as inference
    engines route): recorded after a capacity drop, a route is the sentinel and the kept ones are renormalised among
    themselves (the gate test above replays the routes chosen before capacity)."""
    torch.manual_seed(0)
    model = GPTMoEForCausalLM(tiny_gpt_config(num_hidden_layers=3, moe_layer_frequency=2)).train()
    ids = torch.randint(3, 97, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    normal = model(ids, attention_mask=mask, labels=ids, output_router_logits=True)
    assert len(normal.router_expert_ids) == 1
    replayed = model(ids, attention_mask=mask, labels=ids, router_expert_ids=normal.router_expert_ids,
                     output_router_logits=True)
    assert torch.equal(replayed.router_expert_ids[0], normal.router_expert_ids[0])
    torch.testing.assert_close(replayed.logits, normal.logits)
    torch.testing.assert_close(replayed.lm_loss, normal.lm_loss)
    with pytest.raises(ValueError, match="one \\[tokens, k\\] tensor per MoE layer"):
        model(ids, router_expert_ids=normal.router_expert_ids * 2)


@pytest.mark.parametrize("settings", [
    dict(router_score_function="sigmoid", num_expert_groups=2, topk_expert_groups=1, router_expert_bias=True,
         routed_scaling_factor=2.5, router_aux_loss_scope="global_batch"),
    dict(router_aux_loss_scope="sequence", capacity_factor=1.0),
])
def test_new_routing_trains_replays_and_balances_on_meta_without_host_reads(settings):
    """On the `meta` device every host read raises: the new options' forward, backward, replay and the per-step
    balancing stay on the device."""
    from hf_ppmoe.moe import LoadBalancer

    with torch.device("meta"):
        model = GPTMoEForCausalLM(tiny_gpt_config(hidden_size=64, intermediate_size=128, **settings))
    model = model.to(torch.bfloat16).train()  # bf16, as on a GPU (the experts take the grouped-GEMM kernel)
    balancer = LoadBalancer(model)
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    out = model(ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    replayed = model(ids, labels=ids, router_expert_ids=out.router_expert_ids)
    replayed.loss.backward()
    balancer.step()
    assert out.loss.device.type == "meta" and replayed.loss.device.type == "meta"


def test_seq2seq_replay_per_stack_equals_the_normal_forward():
    from helpers import tiny_seq2seq_config

    from hf_ppmoe import Seq2SeqMoEForConditionalGeneration

    torch.manual_seed(0)
    model = Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config()).eval()  # no dropout
    src, labels = torch.randint(3, 97, (2, 7)), torch.randint(3, 97, (2, 5))
    normal = model(src, labels=labels, output_router_logits=True)
    replayed = model(src, labels=labels, encoder_router_expert_ids=normal.encoder_router_expert_ids,
                     decoder_router_expert_ids=normal.decoder_router_expert_ids, output_router_logits=True)
    for a, b in zip(normal.decoder_router_expert_ids, replayed.decoder_router_expert_ids):
        assert torch.equal(a, b)
    torch.testing.assert_close(replayed.logits, normal.logits)
    torch.testing.assert_close(replayed.aux_loss, normal.aux_loss)


def test_export_and_megatron_refuse_the_routing_they_cannot_express():
    from hf_ppmoe.conversion.export import export_reasons
    from hf_ppmoe.megatron.plugin import megatron_lm_args

    model = GPTMoEForCausalLM(tiny_gpt_config(moe_layer_frequency=1, router_score_function="sigmoid",
                                              router_expert_bias=True))
    reasons = " ".join(export_reasons(model, "mixtral"))
    assert "router_score_function='sigmoid'" in reasons and "router_expert_bias=True" in reasons
    megatron_lm_args(model.config, tp=1, pp=1)  # Megatron-core has both (test_megatron_expert_bias.py)
    with pytest.raises(ValueError, match="Megatron's expert bias needs"):
        megatron_lm_args(tiny_gpt_config(router_expert_bias=True), tp=1, pp=1)
