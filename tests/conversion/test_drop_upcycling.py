"""Drop-Upcycling (`upcycle(..., reinit_ratio=r)`): r = 0 is the exact copy; r > 0 re-initialises, in every expert,
the same round(r * F) inner dimensions of its in- and out-projections (a different draw per expert) and keeps the
others, and every tensor outside the experts, as the dense model's."""

import pytest
import torch
from converters import assert_same_outputs, input_ids

from hf_ppmoe.conversion import ConversionError, upcycle


def test_ratio_zero_is_the_exact_upcycle(dense):
    model, folder = dense("llama")
    moe = upcycle(folder, num_experts=4, moe_layer_frequency=1, reinit_ratio=0.0)
    assert_same_outputs(model, moe, input_ids(length=10))
    plain = upcycle(folder, num_experts=4, moe_layer_frequency=1)
    for (name, a), (_, b) in zip(moe.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gated (gate and up fused) and plain MLPs
def test_reinitialised_dimensions_hand_counted(dense, arch):
    model, folder = dense(arch)
    ratio, E = 0.5, 4
    moe = upcycle(folder, num_experts=E, moe_layer_frequency=1, reinit_ratio=ratio, seed=3)
    assert moe.config.conversion["reinit_ratio"] == ratio
    plain = upcycle(folder, num_experts=E, moe_layer_frequency=1, seed=3)  # exact copies of the dense FFN
    gated = moe.config.gated_mlp
    dropped_sets = []
    for layer, copy in zip(moe.model.layers, plain.model.layers):
        name = "gate_up_proj" if gated else "up_proj"
        down, down_ref = layer.mlp.experts.down_proj.detach(), copy.mlp.experts.down_proj.detach()  # [E, H, F]
        ins, ins_ref = getattr(layer.mlp.experts, name).detach(), getattr(copy.mlp.experts, name).detach()
        F = down.shape[-1]
        for e in range(E):
            changed = (down[e] != down_ref[e]).any(dim=0)  # [F]
            assert int(changed.sum()) == round(ratio * F), e
            for p in range(ins.shape[1] // F):  # the same dimensions in the gate and up projections
                part, part_ref = ins[e, p * F : (p + 1) * F], ins_ref[e, p * F : (p + 1) * F]
                assert torch.equal((part != part_ref).any(dim=-1), changed), e
            dropped_sets.append(tuple(changed.nonzero().flatten().tolist()))
    assert len(set(dropped_sets)) > 1  # a different draw per expert
    for (name, tensor), (_, reference) in zip(moe.state_dict().items(), plain.state_dict().items()):
        if "experts" not in name or "bias" in name:  # outside the experts' weights: the exact upcycle's tensors
            assert torch.equal(tensor, reference), name
    with pytest.raises(ConversionError, match="reinit_ratio=1.5"):
        upcycle(folder, num_experts=E, reinit_ratio=1.5)
