"""Both families under reentrant gradient checkpointing (what PEFT's k-bit preparation uses) give the gradients of
no checkpointing, router losses included; a Seq2Seq-MoE checkpoint without `shared.weight` reports it missing and
initialises it instead of keeping a meta tensor; Seq2SeqMoEConfig states its head_dim; with the `einsum` experts implementation a
non-finite input stays in its own token, as with `index`."""

import copy

import pytest
import torch
from helpers import tiny_gpt_config, tiny_seq2seq_config
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.moe import MoELayer

# large router loss coefficients: a router gradient lost by the checkpointing would show
LOSSES = dict(router_aux_loss_coef=0.5, router_z_loss_coef=0.1, hidden_dropout=0.1)


def gpt_case():
    ids = torch.randint(3, 97, (2, 8))
    return GPTMoEForCausalLM(tiny_gpt_config(router_type="gshard", **LOSSES)), dict(input_ids=ids, labels=ids)


def seq2seq_case():
    ids = torch.randint(3, 97, (2, 8))
    model = Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config(router_type="gshard", **LOSSES))
    return model, dict(input_ids=ids, labels=ids[:, :5])


@pytest.mark.parametrize("case", [gpt_case, seq2seq_case], ids=["gpt_moe", "seq2seq_moe"])
def test_models_reentrant_gradient_checkpointing_equals_no_checkpointing(case):
    model, inputs = case()
    model.train()

    def loss_and_grads(m):
        m.zero_grad()
        torch.manual_seed(1)  # the same dropout and random routing; checkpointing replays them
        loss = m(**inputs).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    plain_loss, plain = loss_and_grads(model)
    checkpointed = copy.deepcopy(model)
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    assert all(layer.gradient_checkpointing for layer in checkpointed.modules() if hasattr(layer, "_gradient_checkpointing_func"))
    loss, grads = loss_and_grads(checkpointed)
    torch.testing.assert_close(loss, plain_loss)
    assert grads.keys() == plain.keys() and any(".gate." in name for name in grads)
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], msg=name)


def test_models_checkpoint_without_shared_embedding_reports_it_missing(tmp_path):
    model = Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config())
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.shared.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "checksums.sha256").unlink()  # edited on purpose (else the checksum check refuses the changed file)
    loaded, info = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, output_loading_info=True)
    assert "model.shared.weight" in info["missing_keys"]
    shared = loaded.model.shared.weight
    assert shared.device.type == "cpu" and loaded.model.encoder.embed_tokens.weight is shared
    assert torch.isfinite(shared).all() and 0.1 < shared.std() / model.model.shared.weight.std() < 10  # initialised
    ids = torch.randint(3, 97, (1, 5))
    assert torch.isfinite(loaded(ids, labels=ids).loss)


def test_models_seq2seq_config_states_its_head_dim():
    assert tiny_seq2seq_config().head_dim == 32 // 4
    assert tiny_seq2seq_config(hidden_size=30, head_dim=8).head_dim == 8


@pytest.mark.parametrize("capacity_factor", [None, 1.5])
def test_models_einsum_experts_keep_a_non_finite_input_in_its_token(capacity_factor):
    outputs = {}
    for implementation in ("index", "einsum"):
        torch.manual_seed(0)
        config = tiny_gpt_config(experts_implementation=implementation, router_type="gshard", capacity_factor=capacity_factor)
        layer = MoELayer(config).eval()
        x = torch.randn(6, 32)
        x[2, 5], x[4, 0] = float("nan"), float("inf")
        outputs[implementation], _ = layer(x)
    for out in outputs.values():
        assert torch.isnan(out).any(-1).tolist() == [False, False, True, False, True, False]
    finite = torch.tensor([0, 1, 3, 5])
    torch.testing.assert_close(outputs["einsum"][finite], outputs["index"][finite])


def test_model_outputs_are_not_views():
    """Issue 38: FSDP2 warns (every step) when a wrapped model returns a view, on which an in-place op would skip its
    all-gather; the router losses were `unbind` views of one stacked mean."""
    ids = torch.randint(3, 50, (2, 8))
    outputs = [GPTMoEForCausalLM(tiny_gpt_config())(ids, labels=ids),
               Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config())(ids, labels=ids)]
    for out in outputs:
        views = [name for name, value in out.items() if torch.is_tensor(value) and value._base is not None]
        assert views == [], views
