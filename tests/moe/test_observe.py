"""hf_ppmoe.moe.observe: the one way routing is observed outside a model's forward. `RoutingHooks` hands every MoE
layer's `Routing` to its callback, the very one the model output records; removing the hooks stops it; `keep_only`
forgets the layers a pipeline stage does not hold."""

import pytest
import torch
from helpers import tiny_gpt_config, tiny_seq2seq_config

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.modeling.stages import keep_layers
from hf_ppmoe.moe import MoELayer, Routing, RoutingHooks

MOE_NAMES = ["model.layers.1.mlp", "model.layers.3.mlp"]


def gpt():
    # 4 layers, MoE in layers 1 and 3
    return GPTMoEForCausalLM(tiny_gpt_config(num_hidden_layers=4, moe_layer_frequency=2)).eval()


def test_every_moe_layer_hands_the_routing_it_returns_to_the_callback():
    model, ids = gpt(), torch.randint(3, 97, (2, 5))
    seen = []
    hooks = RoutingHooks(model, lambda name, routing: seen.append((name, routing)))
    assert list(hooks.layers) == MOE_NAMES
    out = model(ids, output_router_logits=True)
    assert [name for name, _ in seen] == MOE_NAMES and all(isinstance(r, Routing) for _, r in seen)
    # the same Routing Transformers' recorder records for the model output: the very tensors
    assert all(r.router_logits is logits for (_, r), logits in zip(seen, out.router_logits))
    assert all(r.expert_ids is ids_ for (_, r), ids_ in zip(seen, out.router_expert_ids))
    assert seen[0][1].router_logits.shape == (10, 4)
    hooks.remove()
    model(ids)
    assert len(seen) == 2


def test_a_with_block_removes_the_hooks_and_names_are_those_of_the_module_given():
    model, ids = gpt(), torch.randint(3, 97, (1, 4))
    seen = []
    with RoutingHooks(model.model.layers, lambda name, routing: seen.append(name)):
        model(ids)
    model(ids)
    assert seen == ["1.mlp", "3.mlp"]


def test_encoder_and_decoder_layers_are_all_observed():
    model = Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config()).eval()
    seen = []
    with RoutingHooks(model, lambda name, routing: seen.append(name)):
        model(torch.randint(3, 97, (2, 5)), decoder_input_ids=torch.randint(3, 97, (2, 3)))
    assert seen == [f"{stack}.layers.{i}.mlp" for stack in ("model.encoder", "model.decoder") for i in range(2)]


def test_keep_only_forgets_the_layers_a_pipeline_stage_does_not_hold():
    model, ids = gpt(), torch.randint(3, 97, (1, 4))
    seen = []
    hooks = RoutingHooks(model, lambda name, routing: seen.append(name))
    forgotten = model.model.layers[1].mlp
    keep_layers(model.model.layers, held=[2, 3])  # the second of two stages
    hooks.keep_only(model)
    assert list(hooks.layers) == ["model.layers.3.mlp"]  # the whole model's name
    model(ids)
    forgotten(torch.randn(1, 4, 32))  # a layer it forgot: its hook is gone too
    assert seen == ["model.layers.3.mlp"]
    assert isinstance(forgotten, MoELayer)


def test_router_monitor_sums_the_routing_the_model_output_records():
    """RouterMonitor, a consumer of RoutingHooks: over two training forwards with capacity (routes dropped), its
    statistics are those of the Routings the model output records (`output_router_logits`) on the same batches."""
    from hf_ppmoe.training.tracking import RouterMonitor

    model = GPTMoEForCausalLM(tiny_gpt_config(num_hidden_layers=4, moe_layer_frequency=2, capacity_factor=1.0)).train()
    E, K = model.config.num_experts, model.config.num_experts_per_tok
    monitor = RouterMonitor(model)
    counts, dropped = {}, {}
    for _ in range(2):
        ids = torch.randint(3, 97, (2, 8))
        out = model(ids, labels=ids, output_router_logits=True)
        for name, routes in zip(MOE_NAMES, out.router_expert_ids):
            c = torch.stack([(routes == e).sum() for e in range(E)]).float()
            counts[name] = counts.get(name, 0) + c
            dropped.setdefault(name, []).append(1 - c.sum() / (ids.numel() * K))
    metrics = monitor.collect()
    assert any(sum(d) > 0 for d in dropped.values()), "the case should drop routes"
    for name in MOE_NAMES:
        short = name.removeprefix("model.").removesuffix(".mlp")
        c = counts[name]
        assert metrics[f"expert_load_cv/{short}"] == pytest.approx((c.std(unbiased=False) / c.mean()).item(), rel=1e-5)
        assert metrics[f"dropped_fraction/{short}"] == pytest.approx(torch.stack(dropped[name]).mean().item(), abs=1e-6)
    monitor.remove()
    model(ids, labels=ids)
    assert monitor.collect() == {}
