"""The device-side execution path: operators per layer constant in E, torch's grouped GEMM and the fallback loop give
the same numbers, rows the kernel leaves undefined never leak, any dtype and size runs."""

import copy

import pytest
import torch
from helpers import GPT2_STYLE, tiny_gpt_config, tiny_seq2seq_config
from test_experts import GATE_SETTINGS, MLP_STYLES, run

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.moe import MoELayer
from hf_ppmoe.moe import kernels as kernels_module


def operators(layer, x):
    """Top-level aten operators of one forward+backward (each is at least one kernel launch on a GPU)."""
    run(layer, x)  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(layer, x)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


@pytest.mark.parametrize("gate", [GATE_SETTINGS[0], GATE_SETTINGS[3]], ids=["topk-dropless", "gshard-capacity"])
def test_operators_per_layer_do_not_grow_with_the_number_of_experts(gate):
    x = torch.randn(4, 32, 32)
    counts = {E: operators(MoELayer(tiny_gpt_config(num_experts=E, **gate)).train(), x) for E in (4, 16, 64)}
    assert max(counts.values()) <= 1.1 * min(counts.values()), counts


def poison(y, offs):
    """What torch's grouped_mm leaves undefined set to NaN, as uninitialised memory (or a faulty kernel) may hold it:
    rows past the last offset ([N, out] results) and the blocks of experts without rows ([E, in, out] results)."""
    if y.dim() == 2:
        return torch.where(torch.arange(len(y)).unsqueeze(-1) < offs[-1], y, float("nan"))
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    return torch.where((counts > 0).view(-1, 1, 1), y, float("nan"))


def poisoned_grouped_mm(real):
    """torch's grouped_mm, forward and backward, with its undefined rows and blocks poisoned (see `poison`), so that
    a leak of them into outputs or gradients cannot go unseen."""

    class Poisoned(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, offs):
            ctx.save_for_backward(x, w, offs)
            return poison(real(x, w, offs=offs), offs)

        @staticmethod
        def backward(ctx, grad):
            x, w, offs = ctx.saved_tensors
            grad_x = poison(real(grad, w.transpose(-2, -1), offs=offs), offs)
            return grad_x, poison(real(x.t(), grad, offs=offs), offs), None

    return lambda x, w, offs: Poisoned.apply(x, w, offs)


@pytest.mark.parametrize("mlp", MLP_STYLES, ids=["gated", "plain_bias"])
@pytest.mark.parametrize("gate", GATE_SETTINGS, ids=lambda g: f"{g['router_type']}-cf{g.get('capacity_factor')}")
def test_kernel_and_fallback_agree_and_undefined_rows_never_leak(gate, mlp, monkeypatch):
    layer = MoELayer(tiny_gpt_config(num_experts=4, **gate, **mlp)).train()
    x = torch.randn(3, 8, 32)
    x[0, :3] = 0  # some routes dropped or sentinel-heavy batches happen either way with capacity
    monkeypatch.setattr(kernels_module.F, "grouped_mm", poisoned_grouped_mm(torch.nn.functional.grouped_mm))
    assert kernels_module.grouped_kernel_available(x.view(-1, 32), layer.experts.in_proj.transpose(-2, -1))
    y, gx, grads, routing = run(layer, x)
    no_kernel = tuple(row for row in kernels_module.CAPABILITIES if row.implementation != "index_kernel")
    monkeypatch.setattr(kernels_module, "CAPABILITIES", no_kernel)
    y_ref, gx_ref, g_ref, _ = run(layer, x)
    assert torch.isfinite(y).all() and torch.isfinite(gx).all()
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gx, gx_ref, atol=1e-6, rtol=1e-5)
    for name in g_ref:
        assert torch.isfinite(grads[name]).all(), name
        torch.testing.assert_close(grads[name], g_ref[name], atol=1e-6, rtol=1e-5, msg=name)


def test_capability_check():
    w = lambda E, i, o, dtype: torch.zeros(E, o, i, dtype=dtype).transpose(-2, -1)  # stored output-first
    ok = kernels_module.grouped_kernel_available
    assert ok(torch.zeros(5, 32), w(4, 32, 48, torch.float32))
    assert ok(torch.zeros(5, 32, dtype=torch.bfloat16), w(4, 32, 48, torch.bfloat16))
    assert not ok(torch.zeros(5, 32, dtype=torch.float64), w(4, 32, 48, torch.float64))  # dtype the kernel lacks
    assert not ok(torch.zeros(5, 30), w(4, 30, 48, torch.float32))  # 120-byte rows: not a multiple of 16
    assert not ok(torch.zeros(5, 32), w(4, 32, 6, torch.float32))
    assert not ok(torch.zeros(5, 32, dtype=torch.bfloat16), w(4, 32, 12, torch.bfloat16))  # 24 bytes


ODD = dict(hidden_size=30, intermediate_size=6, num_attention_heads=3, num_key_value_heads=3)


@pytest.mark.parametrize(
    "dtype, sizes",
    [(torch.float64, {}), (torch.float16, {}), (torch.bfloat16, {}), (torch.float32, ODD), (torch.bfloat16, ODD)],
    ids=["float64", "float16", "bfloat16", "float32-odd", "bfloat16-odd"],
)
@pytest.mark.parametrize("family", ["gpt", "seq2seq"])
def test_any_dtype_and_size_trains_and_generates_like_float32(dtype, sizes, family):
    """Forward, backward and generate in every dtype and at sizes the grouped kernel refuses (fallback), against the
    float32 model with the same weights."""
    torch.manual_seed(0)
    if family == "gpt":
        reference = GPTMoEForCausalLM(tiny_gpt_config(router_type="gshard", capacity_factor=1.5, **sizes))
    else:
        reference = Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config(router_type="topk", **sizes))
    model = copy.deepcopy(reference).to(dtype)
    ids = torch.randint(3, 97, (2, 7))
    tol = {torch.float64: 1e-5, torch.float32: 1e-5}.get(dtype, 5e-2)
    for m in (reference, model):
        torch.manual_seed(1)  # same random routing draws
        m.train()(input_ids=ids, labels=ids).loss.backward()
    logits = [m.eval()(input_ids=ids, labels=ids).logits.float() for m in (model, reference)]
    torch.testing.assert_close(*logits, atol=tol * 10, rtol=tol)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.isfinite(p.grad).all(), name
        torch.testing.assert_close(p.grad.float(), q.grad, atol=tol * 10, rtol=tol * 10, msg=name)
    out = model.eval().generate(ids, max_new_tokens=4, do_sample=False)
    if dtype in (torch.float64, torch.float32):
        assert torch.equal(out, reference.eval().generate(ids, max_new_tokens=4, do_sample=False))
