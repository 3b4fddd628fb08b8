"""Issue 46: upcycling with the defaults left experts dead. A zero router ties every expert, so the first k take every
token, and identical copies the router never tells apart get the same gradients and stay copies. The default,
`router_init="auto"`, is a random router where that is exact (topk renormalised, gshard) and zeros where only a
uniform router is (switch, prototype, topk without renormalisation): exact logits for every gate, and, for the
default gate, every expert routed to and every expert its own after a short training run
(benchmarks/router_init.py measures all gates over 3 seeds)."""

import pytest
import torch
from converters import GATES
from transformers import LlamaConfig, LlamaForCausalLM

from hf_ppmoe.conversion import upcycle
from hf_ppmoe.training.tracking import RouterMonitor

AUTO = {"topk": "random", "topk-unnormalized": "zeros", "topk-m6t": "random", "switch": "zeros", "gshard": "random",
        "prototype": "zeros"}


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def experts_without_routes(model, ids) -> list[int]:
    """Per MoE layer, the experts no token of `ids` is routed to (evaluation mode, as after upcycling)."""
    monitor = RouterMonitor(model)
    model.eval()
    with torch.no_grad():
        model(ids, labels=ids)
    stats = monitor.collect()
    monitor.remove()
    return [v for k, v in sorted(stats.items()) if k.startswith("dead_experts/")]


def distinct_experts(model) -> list[int]:
    """Per MoE layer, how many experts differ from each other (identical copies count once)."""
    return [len({tuple(torch.cat([p[e].flatten() for p in m.parameters()]).tolist()) for e in range(m.num_experts)})
            for name, m in model.named_modules() if name.endswith("mlp.experts")]


def train(model, steps: int = 8) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = torch.Generator().manual_seed(1)
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, 128, (8, 32), generator=batches)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_the_default_router_is_exact_and_every_expert_trains(llama):
    ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = llama(ids).logits
    runs = {}
    for init in ("auto", "zeros"):
        moe = upcycle(llama, num_experts=4, router_init=init) if init == "zeros" else upcycle(llama, num_experts=4)
        with torch.no_grad():
            torch.testing.assert_close(moe.eval()(ids).logits, dense, atol=1e-5, rtol=1e-5)  # both exact
        before = experts_without_routes(moe, ids)
        train(moe)
        runs[init] = before, distinct_experts(moe), moe.config.conversion["router_init"]
    # the default: every expert of both MoE layers gets tokens at once, and after training all 4 are experts of their own
    assert runs["auto"] == ([0, 0], [4, 4], "random")
    # the former default, held as the reference the counts can tell apart: the first 2 experts take every token, and
    # the two pairs of copies stay copies
    assert runs["zeros"] == ([2, 2], [2, 2], "zeros")


@pytest.mark.parametrize("gate", GATES)
def test_auto_takes_the_exact_router_of_each_gate(llama, gate):
    """A random router where the gate's weights sum to one, zeros elsewhere: no gate warns that it is inexact."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moe = upcycle(llama, **(dict(num_experts=4, moe_layers=[1]) | GATES[gate]))
    assert moe.config.conversion["router_init"] == AUTO[gate]
    router = moe.model.layers[1].mlp.gate.weight
    assert bool((router == 0).all()) == (AUTO[gate] == "zeros")
