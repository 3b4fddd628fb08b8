"""Gates against hand-worked cases and literal transcriptions of the papers' algorithms."""

import copy
import math

import pytest
import torch
from helpers import tiny_gpt_config

from hf_ppmoe.moe import Gate, MoELayer, get_gate_class, register_gate
from hf_ppmoe.moe.gates import GATES
from hf_ppmoe.moe.losses import route_fractions


def make_gate(router_type, *, num_experts, top_k, eye=True, **overrides):
    """A gate whose router weight is the identity, so its logits are the hidden states we pass in."""
    config = tiny_gpt_config(
        hidden_size=num_experts if eye else 32,
        num_attention_heads=1,
        num_key_value_heads=1,
        position_embedding_type="learned",  # hidden_size may be odd here; only the gate is built
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        router_type=router_type,
        **overrides,
    )
    gate = get_gate_class(router_type)(config)
    with torch.no_grad():
        gate.weight.copy_(torch.eye(num_experts) if eye else torch.randn_like(gate.weight))
    return gate


def dense_combine(routing):
    """[T, E] combine weights from a Routing (sentinel routes dropped)."""
    T, E = routing.expert_ids.shape[0], routing.num_experts
    out = torch.zeros(T, E + 1)
    out.scatter_add_(1, routing.expert_ids, routing.weights)
    return out[:, :E]


def test_switch_capacity_overflow_hand_worked():
    gate = make_gate("switch", num_experts=2, top_k=1, capacity_factor=1.0).train()
    logits = torch.tensor([[2.0, 0.0], [3.0, 0.0], [4.0, 0.0], [0.0, 1.0]])
    r = gate(logits)
    # C = ceil(1.0 * 1 * 4 / 2) = 2: the third token for expert 0 overflows
    assert r.capacity == 2
    assert r.expert_ids.squeeze(1).tolist() == [0, 0, 2, 1]
    p = logits.softmax(-1)
    torch.testing.assert_close(r.weights.squeeze(1), torch.tensor([p[0, 0], p[1, 0], 0.0, p[3, 1]]))
    assert r.tokens_per_expert.tolist() == [2, 1]
    assert r.dropped_fraction.item() == pytest.approx(0.25)
    # Switch aux: E * sum_e f_e P_e with f = [3/4, 1/4]
    expected = 2 * (0.75 * p[:, 0].mean() + 0.25 * p[:, 1].mean())
    torch.testing.assert_close(r.aux_loss, expected)


def test_switch_eval_is_dropless_by_default():
    gate = make_gate("switch", num_experts=2, top_k=1, capacity_factor=1.0).eval()
    r = gate(torch.tensor([[2.0, 0.0], [3.0, 0.0], [4.0, 0.0], [0.0, 1.0]]))
    assert r.capacity is None and r.expert_ids.squeeze(1).tolist() == [0, 0, 0, 1]


GSHARD_LOGITS = torch.tensor([[2.0, 1.0, 0.0], [2.0, 0.0, 1.0], [2.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
G1, G2 = math.e / (math.e + 1), 1 / (math.e + 1)  # normalised top-2 gates of softmax([2, 1, ...])


def test_gshard_capacity_hand_worked():
    # E=3, T=4, C = ceil(0.75 * 2 * 4 / 3) = 2. First routes fill buffers first: t0, t1 -> e0; t2 overflows e0;
    # t3 -> e1. Then second routes: t0 -> e1, t1 -> e2, t2 -> e1 overflows, t3 -> e2. Token 2 is dropped entirely.
    gate = make_gate("gshard", num_experts=3, top_k=2, capacity_factor=0.75, router_random_routing=False).train()
    r = gate(GSHARD_LOGITS)
    assert r.capacity == 2
    assert r.expert_ids.tolist() == [[0, 1], [0, 2], [3, 3], [1, 2]]
    expected = torch.tensor([[G1, G2], [G1, G2], [0.0, 0.0], [G1, G2]])
    torch.testing.assert_close(r.weights, expected)
    assert r.dropped_fraction.item() == pytest.approx(2 / 8)
    # aux = E^2 * mean_e(c_e/S * m_e), c_e counting first choices: [3, 1, 0]
    m = GSHARD_LOGITS.softmax(-1).mean(0)
    torch.testing.assert_close(r.aux_loss, 9 * (torch.tensor([0.75, 0.25, 0.0]) * m).mean())


def test_gshard_random_routing_with_fixed_generator():
    gate = make_gate("gshard", num_experts=3, top_k=2, capacity_factor=0.75).train()
    gate.generator = torch.Generator().manual_seed(0)
    rnd = torch.rand(4, generator=torch.Generator().manual_seed(0))
    assert rnd.tolist() == pytest.approx([0.4963, 0.7682, 0.0885, 0.1320], abs=1e-4)
    r = gate(GSHARD_LOGITS)
    # 2*g2 = 0.538: token 1's second route is skipped (0.768 > 0.538); token 2 overflows as before; token 0 and 3 keep
    assert r.expert_ids.tolist() == [[0, 1], [0, 3], [3, 3], [1, 2]]
    # skipped by chance is not "dropped": only token 2's two routes overflowed, out of 7 chosen
    assert r.dropped_fraction.item() == pytest.approx(2 / 7)


@pytest.mark.parametrize("literal, token3", [(False, [1, 2]), (True, [1, 3])])
def test_gshard_skipped_second_route_and_capacity_hand_worked(literal, token3):
    # C = ceil(0.375 * 2 * 4 / 3) = 1. First routes: t0 -> e0, t1 and t2 overflow e0, t3 -> e1. Second routes: t0 -> e1
    # overflows, t1 -> e2 is skipped by random routing (0.768 > 2 * g2 = 0.538), t2 -> e1 overflows, t3 -> e2 (0.132 <
    # 0.538): by default t1's skipped route left e2's slot free, so t3 gets it; read literally (line 24 after the
    # `if`), t1's skipped route took the slot and t3's second route overflows.
    gate = make_gate(
        "gshard", num_experts=3, top_k=2, capacity_factor=0.375, router_random_routing_takes_capacity=literal
    ).train()
    gate.generator = torch.Generator().manual_seed(0)
    r = gate(GSHARD_LOGITS)
    assert r.capacity == 1
    assert r.expert_ids.tolist() == [[0, 3], [3, 3], [3, 3], token3]


def gshard_reference(probs, capacity, rnd, literal=False):
    """GShard Algorithm 1, transcribed line by line for one group (rnd=None: no random routing). literal=True keeps
    line 24 where the paper puts it, after the `if`: a second route skipped by random routing still counts."""
    S, E = probs.shape
    c = [0] * E
    combine = torch.zeros(S, E)
    top = [probs[s].topk(2) for s in range(S)]
    for s in range(S):
        (g1, g2), (e1, _) = top[s]
        if c[e1] < capacity:
            combine[s, e1] = g1 / (g1 + g2)
            c[e1] += 1
    for s in range(S):
        (g1, g2), (_, e2) = top[s]
        g2n = g2 / (g1 + g2)
        c_ = c[e2]
        if c_ < capacity and (rnd is None or 2 * g2n > rnd[s]):
            combine[s, e2] = g2n
            c[e2] = c_ + 1
        elif literal:
            c[e2] = c_ + 1
    return combine


@pytest.mark.parametrize("random_routing, literal", [(False, False), (True, False), (True, True)])
def test_gshard_matches_algorithm_1_group_local(random_routing, literal):
    E, T, G = 4, 24, 3
    gate = make_gate(
        "gshard", num_experts=E, top_k=2, capacity_factor=1.0, router_num_groups=G, router_random_routing=random_routing,
        router_random_routing_takes_capacity=literal,
    ).train()
    gate.generator = torch.Generator().manual_seed(3)
    logits = torch.randn(T, E) * 2
    r = gate(logits)
    S = T // G
    capacity = math.ceil(1.0 * 2 * S / E)
    assert (r.group_size, r.capacity) == (S, capacity)
    rnd = torch.rand(T, generator=torch.Generator().manual_seed(3)) if random_routing else None
    probs = logits.softmax(-1)
    expected = torch.cat(
        [
            gshard_reference(probs[g * S : (g + 1) * S], capacity, None if rnd is None else rnd[g * S : (g + 1) * S], literal)
            for g in range(G)
        ]
    )
    torch.testing.assert_close(dense_combine(r), expected)
    # group-local counts: no expert gets more than C tokens from any group
    for g in range(G):
        ids = r.expert_ids[g * S : (g + 1) * S].flatten()
        assert torch.bincount(ids, minlength=E + 1)[:E].max() <= capacity


def test_gshard_no_state_between_train_and_eval():
    gate = make_gate("gshard", num_experts=3, top_k=2, capacity_factor=0.75, eval_capacity_factor=2.0)
    gate.generator = torch.Generator().manual_seed(0)
    first = gate.eval()(GSHARD_LOGITS)
    gate.train()(GSHARD_LOGITS)
    second = gate.eval()(GSHARD_LOGITS)
    # eval: C = ceil(2.0 * 2 * 4 / 3) = 6, no random routing: every route kept, and identical before/after training
    assert first.capacity == 6 and (first.expert_ids < 3).all()
    assert torch.equal(first.expert_ids, second.expert_ids) and torch.equal(first.weights, second.weights)


@pytest.mark.parametrize(
    "settings, expected",
    [
        (dict(norm_topk_prob=False), [0.5, 0.3]),  # Mixtral without renormalisation: the probabilities
        (dict(), [0.625, 0.375]),  # renormalised: 0.5 / 0.8, 0.3 / 0.8
        # M6-T Eq. (1): softmax over the two probabilities: 1 / (1 + e^-0.2), 1 / (1 + e^0.2)
        (dict(topk_weighting="m6t"), [0.549834, 0.450166]),
    ],
)
def test_topk_weightings_hand_worked(settings, expected):
    gate = make_gate("topk", num_experts=4, top_k=2, **settings).train()
    r = gate(torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log())
    assert r.expert_ids.tolist() == [[0, 1]]
    assert r.weights[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_topk_renormalisation_and_dropless():
    gate = make_gate("topk", num_experts=4, top_k=2).eval()
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    r = gate(logits)
    assert r.expert_ids.tolist() == [[2, 1]]
    p = logits.softmax(-1)[0]
    torch.testing.assert_close(r.weights[0], torch.stack([p[2], p[1]]) / (p[2] + p[1]))
    raw = make_gate("topk", num_experts=4, top_k=2, norm_topk_prob=False)(logits)
    torch.testing.assert_close(raw.weights[0], torch.stack([p[2], p[1]]))


def test_prototype_hand_worked():
    gate = make_gate("prototype", num_experts=4, top_k=2)
    r = gate(torch.tensor([[1.0, 0.0, 0.0, 3.0]]))
    # prototype 0 = experts {0, 1}: softmax([1, 0]) -> expert 0; prototype 1 = {2, 3}: softmax([0, 3]) -> expert 3
    assert r.expert_ids.tolist() == [[0, 3]]
    torch.testing.assert_close(r.weights[0], torch.tensor([math.e / (math.e + 1), math.exp(3) / (math.exp(3) + 1)]))


def test_prototype_is_sum_of_k_top1_layers():
    """M6-T: k top-1 over k prototypes == the sum of k independent Switch layers, each owning one prototype."""
    Z, F = 2, 3
    proto = MoELayer(tiny_gpt_config(num_experts=Z * F, num_experts_per_tok=Z, router_type="prototype"))
    switches = [MoELayer(tiny_gpt_config(num_experts=F, num_experts_per_tok=1, router_type="switch")) for _ in range(Z)]
    for z, layer in enumerate(switches):
        layer.load_state_dict(
            {k: v[z * F : (z + 1) * F] for k, v in proto.state_dict().items()}
        )
    x = torch.randn(2, 5, 32)
    y, routing = proto(x)
    outputs = [layer(x) for layer in switches]
    torch.testing.assert_close(y, sum(o for o, _ in outputs))
    torch.testing.assert_close(routing.aux_loss, torch.stack([r.aux_loss for _, r in outputs]).mean())
    torch.testing.assert_close(routing.z_loss, torch.stack([r.z_loss for _, r in outputs]).mean())


def test_balanced_aux_loss_is_one_and_z_loss_formula():
    gate = make_gate("topk", num_experts=4, top_k=1)
    logits = torch.zeros(8, 4)
    r = gate(logits)  # uniform probabilities: m_e = 1/4; ties all go to expert 0 -> f = [1, 0, 0, 0]
    torch.testing.assert_close(r.aux_loss, torch.tensor(16 * (0.25 * 1.0) / 4))
    torch.testing.assert_close(r.z_loss, torch.tensor(math.log(4.0) ** 2))
    perm = torch.eye(4).repeat(2, 1) * 50  # each expert gets 2 of 8 tokens, with probability ~1
    torch.testing.assert_close(gate(perm).aux_loss, torch.tensor(1.0), atol=1e-4, rtol=0)


def test_padding_excluded_from_statistics_and_losses():
    gate = make_gate("gshard", num_experts=4, top_k=2, eye=False, router_random_routing=False)
    x = torch.randn(6, 32)
    mask = torch.tensor([True, True, False, True, False, True])
    r_masked = gate(x, mask)
    r_real = gate(x[mask])
    torch.testing.assert_close(r_masked.aux_loss, r_real.aux_loss)
    torch.testing.assert_close(r_masked.z_loss, r_real.z_loss)
    assert torch.equal(r_masked.tokens_per_expert, r_real.tokens_per_expert)
    assert (r_masked.expert_ids[~mask] == 4).all() and (r_masked.weights[~mask] == 0).all()


def test_jitter_never_modifies_the_callers_tensor():
    gate = make_gate("switch", num_experts=4, top_k=1, eye=False, router_jitter_noise=0.5).train()
    x = torch.randn(10, 32)
    before = x.clone()
    a, b = gate(x), gate(x)
    assert torch.equal(x, before)
    assert not torch.equal(a.router_logits, b.router_logits)  # jitter is really applied
    gate.eval()
    assert torch.equal(gate(x).router_logits, gate(x).router_logits)  # and only in training


def test_registry_custom_gate_and_unknown_name():
    @register_gate("first_expert")
    class FirstExpertGate(Gate):
        def select(self, logits):
            T = logits.shape[0]
            ids = torch.zeros(T, self.top_k, dtype=torch.long)
            return ids, torch.ones(T, self.top_k), logits.softmax(-1)

    try:
        layer = MoELayer(tiny_gpt_config(router_type="first_expert", num_experts_per_tok=1))
        _, routing = layer(torch.randn(3, 32))
        assert (routing.expert_ids == 0).all()
    finally:
        GATES.pop("first_expert")
    with pytest.raises(ValueError, match="Known gates: gshard, prototype, switch, topk"):
        get_gate_class("nope")
    with pytest.raises(TypeError):
        register_gate("bad")(object)


@pytest.mark.parametrize(
    "router_type,ids,expected",
    [
        # default: 1/k per route, a sentinel route (4) counts for nothing
        ("topk", [[0, 1], [2, 4]], [[0.5, 0.5, 0, 0], [0, 0, 0.5, 0]]),
        # GShard: first choices only (c_e counts tokens whose top-1 is e)
        ("gshard", [[1, 3], [2, 4]], [[0, 1, 0, 0], [0, 0, 1, 0]]),
        # M6-T: one route per prototype, a one-hot within each prototype's experts
        ("prototype", [[1, 2], [0, 3]], [[0, 1, 1, 0], [1, 0, 0, 1]]),
    ],
)
def test_assignment_counts_routes_as_each_gate_defines(router_type, ids, expected):
    """The c_e of the load-balancing loss, hand-worked per token (4 experts, 2 routes per token): counted from the
    gate's routes (no one-hot), the share of the tokens per expert is the mean of the hand-worked rows."""
    gate = make_gate(router_type, num_experts=4, top_k=2)
    routes, share = gate.assignment(torch.tensor(ids))
    fraction = route_fractions(routes, share, None, num_experts=4, group_size=2)
    torch.testing.assert_close(fraction, torch.tensor(expected, dtype=torch.float32).mean(dim=0, keepdim=True), rtol=0, atol=0)
    padded = route_fractions(routes, share, torch.tensor([True, False]), num_experts=4, group_size=2)
    torch.testing.assert_close(padded, torch.tensor(expected[:1], dtype=torch.float32), rtol=0, atol=0)


@pytest.mark.parametrize("router_type,top_k", [("topk", 2), ("switch", 1), ("gshard", 2), ("prototype", 2)])
def test_bf16_routing_equals_float32_routing_within_bf16_tolerance(router_type, top_k):
    """The router GEMM runs in the activations' dtype and the softmax in float32: a bf16 gate's logits, weights and
    probabilities equal the float32 gate's within bf16's rounding, and it picks the same experts wherever float32's
    choice is not a near tie (a gap larger than bf16 can blur)."""
    gate = make_gate(router_type, num_experts=8, top_k=top_k, eye=False).eval()
    with torch.no_grad():
        gate.weight.div_(32**0.5)  # logits of unit scale, as a trained router's
    x = torch.randn(512, 32)
    ref = gate(x)
    bf16 = copy.deepcopy(gate).bfloat16()(x.bfloat16())
    assert bf16.router_logits.dtype == torch.bfloat16 and bf16.weights.dtype == torch.float32
    torch.testing.assert_close(bf16.router_logits.float(), ref.router_logits, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(bf16.weights, ref.weights, atol=1e-2, rtol=2e-2)
    # float32's margin between each chosen expert and the best one not chosen (per prototype for "prototype")
    groups = top_k if router_type == "prototype" else 1
    probs = ref.router_logits.view(512, groups, -1).softmax(-1)
    ranked = probs.sort(dim=-1, descending=True).values
    per_group = 1 if router_type == "prototype" else top_k
    margin = (ranked[..., per_group - 1] - ranked[..., per_group]).min(dim=-1).values
    clear = margin > 1e-2
    assert clear.float().mean() > 0.8  # the comparison covers most tokens
    assert torch.equal(bf16.expert_ids[clear].sort(-1).values, ref.expert_ids[clear].sort(-1).values)


def test_router_dtype_float32_keeps_the_router_gemm_in_float32():
    """router_dtype="float32" (Switch's setting): a bf16 gate computes its logits in float32, from the bf16 weights."""
    gate = make_gate("switch", num_experts=8, top_k=1, eye=False, router_dtype="float32").bfloat16().eval()
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    r = gate(x)
    assert r.router_logits.dtype == torch.float32
    torch.testing.assert_close(r.router_logits, x.float() @ gate.weight.float().t(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="router_dtype='bfloat16'"):
        tiny_gpt_config(router_dtype="bfloat16")


@pytest.mark.parametrize("T,K,E,S", [(10, 2, 4, 10), (37, 2, 8, 10), (64, 1, 3, 7), (100, 4, 16, 25), (5, 2, 4, 3)])
def test_positions_in_expert_follow_gshard_priority(T, K, E, S):
    """Counted by a sort, against a literal loop: per group, every first route in token order, then every second..."""
    from hf_ppmoe.moe import positions_in_expert

    ids = torch.randint(0, E + 1, (T, K))  # E: sentinel
    expected = torch.full((T, K), -1)
    for g in range(0, T, S):
        filled = [0] * E
        for k in range(K):
            for t in range(g, min(g + S, T)):
                e = int(ids[t, k])
                if e < E:
                    expected[t, k] = filled[e]
                    filled[e] += 1
    got = positions_in_expert(ids, E, S)
    routed = ids < E
    assert torch.equal(got[routed], expected[routed])
