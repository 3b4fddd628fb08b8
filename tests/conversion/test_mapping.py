"""The name tables and their ops: every table maps a real Transformers checkpoint and its inverse maps it back."""

import pytest
import torch
from converters import build_dense

from hf_ppmoe.conversion import ARCHITECTURES, ConversionError, Mapping, Rule
from hf_ppmoe.conversion.io import model_tensors
from hf_ppmoe.conversion.mapping import (
    Chain,
    Concat,
    Copies,
    DictSource,
    InterleaveQKV,
    Merge,
    PadRows,
    Replicate,
    Same,
    Scale,
    Split,
    Stack,
    Transpose,
    Unstack,
    rename,
)


@pytest.mark.parametrize(
    "arch", ["gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "t5-v1.0", "t5-v1.1", "switch"]
)
def test_table_then_inverse_is_the_identity(arch):
    model = build_dense(arch)
    source = model_tensors(model)
    mapping = ARCHITECTURES[model.config.model_type].mapping(model.config, frozenset(source.keys()))
    forward = mapping.apply(source)
    assert not set(forward.keys()) & {"transformer.wte.weight", "model.layers.0.block_sparse_moe.gate.weight", "shared.weight"}
    back = mapping.inverse().apply(DictSource({k: forward.get(k) for k in forward.keys()}))
    assert sorted(back.keys()) == sorted(source.keys())
    for name in source.keys():
        assert torch.equal(back.get(name), source.get(name)), name


def test_gpt2_table_splits_and_transposes_c_attn():
    model = build_dense("gpt2")
    tensors = ARCHITECTURES["gpt2"].mapping(model.config).apply(model_tensors(model))
    c_attn = model.transformer.h[1].attn.c_attn
    x = torch.randn(3, 32)
    q = torch.nn.functional.linear(x, tensors.get("model.layers.1.self_attn.q_proj.weight"), tensors.get("model.layers.1.self_attn.q_proj.bias"))
    v = torch.nn.functional.linear(x, tensors.get("model.layers.1.self_attn.v_proj.weight"), tensors.get("model.layers.1.self_attn.v_proj.bias"))
    torch.testing.assert_close(torch.cat([q, v], -1), c_attn(x)[:, list(range(32)) + list(range(64, 96))])


@pytest.mark.parametrize(
    "op, inputs",
    [
        (Chain(Transpose(), Split(0, 3)), [torch.randn(4, 12)]),
        (Chain(Stack(2), Concat(1, 2)), [torch.randn(3, 5) for _ in range(6)]),
        (Chain(Scale(4.0), Replicate(4)), [torch.randn(5, 3)]),
        (Chain(Scale(0.5), Replicate(3)), [torch.randn(5, 3)]),  # mean of 3 identical copies: exact in float64
        (Replicate(3, merge_weights=(0.25, 0.25, 0.5)), [torch.randn(5, 3, dtype=torch.bfloat16)]),
        (Split(0, 2, blocks=2), [torch.randn(8, 3)]),  # tensor-parallel halves of a fused [gate; up]
        (Chain(Transpose(), Unstack()), [torch.randn(3, 4, 5)]),
        (PadRows(5, 8), [torch.randn(5, 3)]),
        (InterleaveQKV(heads=4, groups=2, head_dim=3), [torch.randn(12, 5), torch.randn(6, 5), torch.randn(6, 5)]),
        (Copies(3), [torch.randn(4)]),
    ],
)
def test_ops_invert_exactly(op, inputs):
    outputs = op(inputs)
    back = op.inverse()(outputs)
    assert len(back) == len(inputs) and all(torch.equal(a, b) for a, b in zip(back, inputs))


def test_merge_is_a_weighted_mean_and_picks_exact_bits():
    x = torch.randn(3, 4, 5)
    torch.testing.assert_close(Merge((0.5, 0.25, 0.25))([x])[0], 0.5 * x[0] + 0.25 * x[1] + 0.25 * x[2])
    assert torch.equal(Merge((0.0, 1.0, 0.0))([x])[0], x[1])


def test_noise_is_per_expert_and_seeded():
    x = torch.zeros(4, 4)
    a, b = Replicate(3, noise_std=0.1, seed=1)([x])[0], Replicate(3, noise_std=0.1, seed=1)([x])[0]
    assert torch.equal(a, b) and not torch.equal(a[0], a[1])
    assert not torch.equal(a, Replicate(3, noise_std=0.1, seed=2)([x])[0])


def test_layers_and_experts_expand():
    rules = [Rule(("l.{i}.e.{e}.w",), ("l.{i}.w",), Stack(1))]
    mapping = Mapping(rules, num_layers=2, num_experts=3)
    assert [(i.sources, i.targets) for i in mapping.instances()] == [
        (("l.0.e.0.w", "l.0.e.1.w", "l.0.e.2.w"), ("l.0.w",)),
        (("l.1.e.0.w", "l.1.e.1.w", "l.1.e.2.w"), ("l.1.w",)),
    ]


def test_missing_and_unexpected_tensors_are_named():
    mapping = Mapping([rename("a", "x"), rename("b", "y")])
    with pytest.raises(ConversionError, match="missing from the source checkpoint: b"):
        mapping.apply(DictSource({"a": torch.ones(1)}))
    with pytest.raises(ConversionError, match="no place for: c"):
        mapping.apply(DictSource({"a": torch.ones(1), "b": torch.ones(1), "c": torch.ones(1)}))
    passthrough = Mapping([rename("a", "x")], passthrough=True).apply(DictSource({"a": torch.ones(1), "c": torch.zeros(1)}))
    assert passthrough.keys() == ["x", "c"]


def test_a_failing_op_names_its_source_tensors():
    mapping = Mapping([Rule(("qkv",), ("q", "k", "v"), Split(0, 3))])
    tensors = mapping.apply(DictSource({"qkv": torch.ones(10)}, "ckpt"))
    with pytest.raises(ConversionError, match=r"qkv \[10\] in ckpt into q, k, v"):
        tensors.get("q")


def test_tensor_parallel_split_of_a_fused_gate_up_takes_a_piece_of_each():
    gate, up = torch.arange(4.0), torch.arange(10.0, 14.0)
    assert [p.tolist() for p in Split(0, 2, blocks=2)([torch.cat([gate, up])])] == [[0, 1, 10, 11], [2, 3, 12, 13]]


def test_padded_rows_are_zeros_and_qkv_interleaves_per_kv_group():
    assert PadRows(2, 4)([torch.ones(2, 3)])[0].sum(1).tolist() == [3, 3, 0, 0]
    q, k, v = torch.arange(4.0).view(4, 1), torch.tensor([[10.0], [11.0]]), torch.tensor([[20.0], [21.0]])
    assert InterleaveQKV(heads=4, groups=2, head_dim=1)([q, k, v])[0].flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def test_same_refuses_copies_that_differ():
    x = torch.randn(3)
    assert Same(2)([x, x.clone()])[0] is x
    with pytest.raises(ConversionError, match="tensor 2 differs from tensor 0; they must be equal copies"):
        Same(3)([x, x.clone(), x + 1])
