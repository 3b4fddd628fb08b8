"""The capability table and the implementations it picks: every implementation gives the index implementation's numbers,
torch's grouped GEMM cannot leak what it leaves undefined into gradients, Transformers' `grouped_mm` falls back
instead of crashing where the kernel cannot run, the README quotes the table the code uses, and the torch floor is
the release with the kernel."""

import re
from pathlib import Path

import pytest
import torch
from helpers import tiny_gpt_config
from test_execution import poisoned_grouped_mm
from test_experts import GATE_SETTINGS, MLP_STYLES

from hf_ppmoe.moe import EXPERTS_FUNCTIONS, MoELayer
from hf_ppmoe.moe import experts as experts_module
from hf_ppmoe.moe import kernels as kernels_module
from hf_ppmoe.moe.kernels import CAPABILITIES, capability, capability_table

ROOT = Path(__file__).resolve().parents[2]


def choose(device, dtype, compiled=False, grad=True, tokens=512, k=2, sm=None, aligned=True):
    return capability(device, sm, dtype, compiled, grad, tokens, tokens * k, aligned).implementation


def test_capability_table_rows():
    bf16, fp32, fp16 = torch.bfloat16, torch.float32, torch.float16
    # sync-free kernel: bf16 on sm90 / sm100 only, eager and compiled, training and decoding
    for sm in ((9, 0), (10, 0)):
        for compiled in (False, True):
            assert choose("cuda", bf16, compiled, sm=sm) == "index_kernel"
            assert choose("cuda", bf16, compiled, grad=False, tokens=1, sm=sm) == "index_kernel"
    # A100, L4/L40, RTX: training syncs; decoding (no gradients) does not
    for sm, dtype in [((8, 0), bf16), ((8, 9), bf16), ((12, 0), bf16), ((9, 0), fp32), ((9, 0), fp16)]:
        row = capability("cuda", sm, dtype, False, True, 512, 1024, True)
        assert (row.implementation, row.syncs) == ("index_loop", True), (sm, dtype)
        assert choose("cuda", dtype, grad=False, tokens=32, sm=sm) == "all_experts"
        assert choose("cuda", dtype, compiled=True, grad=False, tokens=1024, sm=sm) == "all_experts"
        assert choose("cuda", dtype, grad=False, tokens=65, sm=sm) == "index_loop"
        assert choose("cuda", dtype, compiled=True, grad=False, tokens=1025, sm=sm) == "index_loop"
    # sizes off the 16-byte rule never reach the kernel
    assert choose("cuda", bf16, sm=(9, 0), aligned=False) == "index_loop"
    assert choose("cpu", fp32, aligned=False) == "index_loop"
    # CPU: the kernel in eager mode, bf16 only when compiled, the decoding shortcut for one or two routes
    assert choose("cpu", fp32) == "index_kernel"
    assert choose("cpu", fp32, compiled=True) == "index_loop"
    assert choose("cpu", bf16, compiled=True) == "index_kernel"
    assert choose("cpu", torch.float64) == "index_loop"
    assert choose("cpu", fp32, grad=False, tokens=1) == "cpu_decode"
    assert choose("cpu", fp32, grad=False, tokens=3) == "index_kernel"
    assert all(row.implementation in EXPERTS_FUNCTIONS for row in CAPABILITIES)


def test_readme_and_docs_quote_the_capability_table():
    table = capability_table()
    for page in ("docs/gpu.md",):  # the README is a front page; docs/models.md links to this table
        assert table in (ROOT / page).read_text(), f"{page} does not quote hf_ppmoe.moe.capability_table()"


def test_torch_floor_is_the_release_with_grouped_mm():
    floor = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert floor == kernels_module.GROUPED_MM_MIN_TORCH


def test_torch_without_grouped_mm_says_so_and_takes_the_loop(monkeypatch, caplog):
    """An older torch (no torch.nn.functional.grouped_mm) runs the loop, with a warning that names the fix."""
    monkeypatch.delattr(kernels_module.F, "grouped_mm")
    monkeypatch.setattr(kernels_module.logger, "warning_once", kernels_module.logger.warning)  # not deduplicated
    with caplog.at_level("WARNING"):
        layer = MoELayer(tiny_gpt_config())
    assert "torch>=" in caplog.text and "grouped_mm" in caplog.text
    assert choose("cpu", torch.float32) == "index_loop"
    assert choose("cuda", torch.bfloat16, sm=(9, 0)) == "index_loop"
    assert layer.experts.implementation(torch.zeros(8, 32), torch.zeros(8, 2, dtype=torch.long)) == "index_loop"


def run_as(layer, name, x, grad):
    """The layer's experts run as implementation `name` (its routing fixed by the gate), output and gradients."""
    layer.zero_grad()
    torch.manual_seed(0)
    x = x.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        routing = layer.gate(x)
        y = EXPERTS_FUNCTIONS[name](layer.experts, x, routing.expert_ids, routing.weights)
        if not grad:
            return y, None
        y.square().sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in layer.experts.named_parameters()}


@pytest.mark.parametrize("mlp", MLP_STYLES, ids=["gated", "plain_bias"])
@pytest.mark.parametrize("gate", GATE_SETTINGS, ids=lambda g: f"{g['router_type']}-cf{g.get('capacity_factor')}")
@pytest.mark.parametrize("name", ["all_experts", "cpu_decode", "index_loop", "einsum"])
def test_every_implementation_gives_the_kernel_numbers(name, gate, mlp):
    """Outputs without gradients (and gradients where the implementation trains) equal `index_kernel`'s, dropped
    routes and padding included."""
    layer = MoELayer(tiny_gpt_config(num_experts=4, **gate, **mlp)).train()
    tokens = 2 // layer.gate.top_k if name == "cpu_decode" else 24  # the decoding shortcut takes two routes at most
    x = torch.randn(tokens, 32)
    trains = name in ("index_loop", "einsum")
    y_ref, g_ref = run_as(layer, "index_kernel", x, trains)
    y, grads = run_as(layer, name, x, trains)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    for n in g_ref or {}:
        torch.testing.assert_close(grads[n], g_ref[n], atol=1e-5, rtol=1e-5, msg=n)


def test_all_experts_keeps_a_non_finite_expert_output_out_of_tokens_not_routed_to_it():
    layer = MoELayer(tiny_gpt_config(num_experts=4, num_experts_per_tok=1, router_type="switch")).eval()
    x = torch.randn(6, 32)
    routing = layer.gate(x)
    unused = next(e for e in range(4) if not (routing.expert_ids == e).any())
    with torch.no_grad():
        layer.experts.down_proj[unused] = float("inf")
        y = EXPERTS_FUNCTIONS["all_experts"](layer.experts, x, routing.expert_ids, routing.weights)
    assert torch.isfinite(y).all()


def test_empty_experts_and_sentinel_tails_get_exact_zero_gradients_whatever_the_kernel_writes(monkeypatch):
    """Eight experts, three tokens, capacity: some experts get no row, some routes are dropped (sentinel tail). torch's
    grouped GEMM is replaced by one that writes NaN into everything it leaves undefined, forward and backward (as
    faulty kernels have): the gradients are still the loop's, and exactly zero for the experts without rows."""
    config = tiny_gpt_config(num_experts=8, num_experts_per_tok=2, capacity_factor=1.0, mlp_bias=True)
    layer = MoELayer(config).train()
    x = torch.randn(3, 32)
    monkeypatch.setattr(kernels_module.F, "grouped_mm", poisoned_grouped_mm(torch.nn.functional.grouped_mm))
    y, grads = run_as(layer, "index_kernel", x, True)
    y_ref, g_ref = run_as(layer, "index_loop", x, True)
    ids = layer.gate(x).expert_ids
    empty = [e for e in range(8) if not (ids == e).any()]
    assert empty and (ids == 8).any(), "the case should have empty experts and dropped routes"
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-5)
    for n in g_ref:
        torch.testing.assert_close(grads[n], g_ref[n], atol=1e-6, rtol=1e-5, msg=n)
        assert (grads[n][empty] == 0).all(), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("hidden,inner", [(32, 1), (32, 2), (32, 3), (30, 6), (16, 4), (24, 5), (8, 8)])
def test_transformers_grouped_mm_dispatch_falls_back_instead_of_crashing(hidden, inner, dtype, monkeypatch, caplog):
    """`experts_implementation="grouped_mm"` (Transformers' kernel on our weights) at sizes and dtypes the kernel refuses (rows
    off its 16-byte rule, float64) runs the table's fallback, with the index implementation's numbers, and says so
    (once: Transformers' `warning_once`, made plain here to count it)."""
    sizes = dict(hidden_size=hidden, intermediate_size=inner, num_attention_heads=1, num_key_value_heads=1)
    layer = MoELayer(tiny_gpt_config(**sizes, experts_implementation="grouped_mm")).to(dtype).train()
    reference = MoELayer(tiny_gpt_config(**sizes)).to(dtype).train()
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(10, hidden, dtype=dtype)
    monkeypatch.setattr(experts_module.logger, "warning_once", experts_module.logger.warning)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), caplog.at_level("WARNING"):
            y, _ = layer(x)
            y_ref, _ = reference(x)
        torch.testing.assert_close(y, y_ref)
    said = [r.getMessage() for r in caplog.records if 'experts_implementation="grouped_mm"' in r.getMessage()]
    kernel = kernels_module.aligned(dtype, hidden, inner) and dtype != torch.float64
    assert len(said) == (0 if kernel else 2), said  # one per forward here; Transformers' warning_once says it once
    if not kernels_module.aligned(dtype, hidden, inner):
        assert f"hidden_size={hidden}" in said[0] and "16 bytes" in said[0], said
    assert (layer.experts.implementation(x, torch.zeros(10, 2, dtype=torch.long)) == "grouped_mm") == kernel


def test_our_kernels_are_offered_to_our_experts_only():
    """"index" and "einsum" read our `Experts`' weights and config: Transformers' global experts registry does not
    list them, so Transformers' own MoE models refuse them by name when set (instead of failing in the forward), while
    ours take them; Transformers' grouped_mm still runs a Qwen3-MoE model with hf_ppmoe imported."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from hf_ppmoe import GPTMoEForCausalLM

    assert not {"index", "einsum"} & set(ALL_EXPERTS_FUNCTIONS.keys())
    config = Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                            num_experts_per_tok=2)
    qwen = Qwen3MoeForCausalLM(config).eval()
    for name in ("index", "einsum"):
        with pytest.raises(ValueError, match=f'experts_implementation="{name}"'):
            qwen.set_experts_implementation(name)
    ids = torch.randint(3, 97, (2, 5))
    reference = qwen(ids).logits
    qwen.set_experts_implementation("grouped_mm")
    torch.testing.assert_close(qwen(ids).logits, reference)
    ours = GPTMoEForCausalLM(tiny_gpt_config())
    for name in ("einsum", "index"):
        ours.set_experts_implementation(name)
        assert ours.config._experts_implementation == name
    with pytest.raises(ValueError, match="Our models also take 'index', 'einsum'"):
        ours.set_experts_implementation("no_such_kernel")


def test_experts_run_what_the_registry_holds_under_the_name_they_resolve(monkeypatch):
    """`Experts.forward` is one registry lookup: the name `implementation` resolves (the decoding shortcut included)
    and any function registered under a name, ours or Transformers'."""
    layer = MoELayer(tiny_gpt_config()).eval()
    x, ids = torch.randn(1, 32), torch.tensor([[0, 3]])
    with torch.no_grad():
        assert layer.experts.implementation(x, ids) == "cpu_decode"
        assert layer.experts.implementation(torch.randn(5, 32), ids.expand(5, 2)) == "index_kernel"
    assert layer.experts.implementation(x, ids) == "index_kernel"
    calls = []
    monkeypatch.setitem(EXPERTS_FUNCTIONS, "mine", lambda experts, *args: calls.append(args) or args[0])
    layer.experts.config._experts_implementation = "mine"
    y, _ = layer(x)
    assert len(calls) == 1 and torch.equal(y, x)
    layer.experts.config._experts_implementation = "batched_mm"  # Transformers' own, through the same registry
    assert layer.experts.implementation(x, ids) == "batched_mm" and "batched_mm" in EXPERTS_FUNCTIONS


@pytest.mark.parametrize("grad", [False, True], ids=["decoding", "training"])
def test_few_routes_without_gradients_touch_only_the_routed_experts(grad, monkeypatch):
    """A decoding step (no gradients, fewer routes than 4 per expert) gives rows only to the experts it routes to:
    the grouped GEMM reads no other expert's weights. With gradients every expert has a row (its anchor), so no
    weight gradient is left to the kernel's handling of an empty group."""
    layer = MoELayer(tiny_gpt_config(num_experts=16, num_experts_per_tok=2)).eval()
    blocks = []
    real = kernels_module.F.grouped_mm

    def spy(x, w, offs):
        blocks.append(torch.diff(offs, prepend=offs.new_zeros(1)))
        return real(x, w, offs=offs)

    monkeypatch.setattr(kernels_module.F, "grouped_mm", spy)
    x = torch.randn(3, 32)
    with torch.set_grad_enabled(grad):
        out, routing = layer(x)
        assert layer.experts.implementation(x, routing.expert_ids) == "index_kernel"
    routed = set(routing.expert_ids.flatten().tolist())
    with_rows = {e for e, n in enumerate(blocks[0].tolist()) if n > 0}
    assert with_rows == (set(range(16)) if grad else routed)
    assert out.shape == (3, 32) and torch.isfinite(out).all()


def test_few_routes_with_dropped_and_padded_routes_equal_the_einsum_reference():
    """The decoding form's single anchor serves the routes that go nowhere: outputs equal GShard's einsum implementation."""
    config = tiny_gpt_config(num_experts=16, num_experts_per_tok=2, eval_capacity_factor=2.0)
    layer = MoELayer(config).eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        routing = layer.gate(x, torch.tensor([True, True, False, True]))
        assert (routing.expert_ids == 16).any()  # padding (and capacity) left routes going nowhere
        y = EXPERTS_FUNCTIONS["index_kernel"](layer.experts, x, routing.expert_ids, routing.weights)
        ref = EXPERTS_FUNCTIONS["einsum"](layer.experts, x, routing.expert_ids, routing.weights)
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(y[2], torch.zeros(32))
