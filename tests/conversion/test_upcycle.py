"""dense -> MoE: equal logits and greedy tokens for every source architecture and every built-in gate."""

import copy
import json
import warnings

import pytest
import torch
from converters import GATES, SAMPLE_TEXTS, assert_same_outputs, input_ids, read_tensors, tokenizer
from transformers import AutoTokenizer, GenerationConfig

from hf_ppmoe import GPTMoEForCausalLM
from hf_ppmoe.conversion import expert_output_scale, gate_renormalizes, upcycle

ARCHS = ["gpt2", "llama", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("arch", ARCHS)
def test_upcycled_model_equals_dense(dense, arch, gate):
    model, folder = dense(arch)
    options = dict(num_experts=4, moe_layer_frequency=1) | GATES[gate]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zero routers are exact for every gate: no warning
        moe = upcycle(folder, **options)
    assert isinstance(moe, GPTMoEForCausalLM)
    assert all(layer.is_moe for layer in moe.model.layers)
    assert_same_outputs(model, moe, input_ids(length=10))


def test_scale_is_the_inverse_of_the_uniform_combine_sum(dense):
    model, _ = dense("gpt2")
    scales = {g: upcycle(model, **(dict(num_experts=4, moe_layers=[0]) | GATES[g])).config.conversion["expert_output_scale"] for g in GATES}
    assert scales == {"topk": 1.0, "topk-unnormalized": 2.0, "topk-m6t": 1.0, "switch": 4.0, "gshard": 1.0, "prototype": 0.5}


def test_upcycle_from_model_object_equals_folder(dense):
    model, folder = dense("llama")
    a = upcycle(model, num_experts=4, router_type="switch")
    b = upcycle(folder, num_experts=4, router_type="switch")
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


@pytest.mark.parametrize("router_init", ["random", "hidden"])
@pytest.mark.parametrize("gate", ["topk", "gshard"])
def test_learned_router_init_is_exact_for_renormalizing_gates(dense, router_init, gate):
    model, folder = dense("qwen2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moe = upcycle(folder, num_experts=4, router_type=gate, router_init=router_init, sample_texts=SAMPLE_TEXTS)
    assert moe.model.layers[1].mlp.gate.weight.abs().sum() > 0  # a real, non-uniform router
    assert_same_outputs(model, moe)


@pytest.mark.parametrize("gate", ["switch", "topk-unnormalized", "prototype"])
def test_learned_router_init_warns_where_it_is_not_exact(dense, gate):
    model, folder = dense("llama")
    options = dict(num_experts=4, moe_layer_frequency=1, router_init="random", initializer_range=1.0) | GATES[gate]
    assert not gate_renormalizes(upcycle(model, **(dict(num_experts=4, moe_layers=[0]) | GATES[gate])).config)
    with pytest.warns(UserWarning, match="will differ from the dense model"):
        moe = upcycle(folder, **options)
    ids = input_ids()
    assert not torch.allclose(moe(ids).logits, model(ids).logits, atol=1e-3)  # the warning is warranted


def test_eval_capacity_warns(dense):
    _, folder = dense("gpt2")
    with pytest.warns(UserWarning, match="eval_capacity_factor"):
        upcycle(folder, num_experts=4, eval_capacity_factor=0.5)


def test_hidden_router_rows_point_at_their_experts_texts(dense):
    """Row e of each router is the normalized mean FFN input of text e, so by Cauchy-Schwarz text e's mean router
    logits peak at expert e, and the rows have unit norm."""
    _, folder = dense("gpt2")
    moe = upcycle(folder, num_experts=4, moe_layer_frequency=1, router_init="hidden", sample_texts=SAMPLE_TEXTS)
    for layer in moe.model.layers:
        torch.testing.assert_close(layer.mlp.gate.weight.norm(dim=-1), torch.ones(4))
    tok = tokenizer()
    for e, text in enumerate(SAMPLE_TEXTS):
        out = moe(tok(text, return_tensors="pt")["input_ids"], output_router_logits=True)
        for logits in out.router_logits:
            assert logits.mean(0).argmax().item() == e


def test_hidden_router_needs_one_text_per_expert(dense):
    _, folder = dense("gpt2")
    with pytest.raises(ValueError, match="4 in all; got 2"):
        upcycle(folder, num_experts=4, router_init="hidden", sample_texts=SAMPLE_TEXTS[:2])


def test_noise_breaks_symmetry_reproducibly(dense):
    model, folder = dense("mistral")
    a = upcycle(folder, num_experts=4, noise_std=1e-3, seed=3)
    b = upcycle(folder, num_experts=4, noise_std=1e-3, seed=3)
    experts = a.model.layers[1].mlp.experts
    dense_up = torch.cat([model.model.layers[1].mlp.gate_proj.weight, model.model.layers[1].mlp.up_proj.weight])
    deviation = experts.gate_up_proj - dense_up
    assert 0.5e-3 < deviation.std() < 2e-3
    assert not torch.equal(experts.gate_up_proj[0], experts.gate_up_proj[1])
    assert torch.equal(experts.gate_up_proj, b.model.layers[1].mlp.experts.gate_up_proj)


def test_training_upcycles_with_the_same_noise_option(dense):
    """`python -m hf_ppmoe.training --upcycle_from SRC --noise_std S` is upcycle(SRC, noise_std=S); its old name
    --expert_noise_std still works, with a warning."""
    from hf_ppmoe.training import TrainArguments
    from hf_ppmoe.training.build import build_model

    _, folder = dense("mistral")
    options = dict(upcycle_from=str(folder), num_experts=4, seed=3)
    args = TrainArguments(**options, noise_std=1e-3)
    with pytest.warns(FutureWarning, match="--expert_noise_std is deprecated; use --noise_std"):
        old = TrainArguments(**options, expert_noise_std=1e-3)
    expected = upcycle(folder, num_experts=4, router_init="random", noise_std=1e-3, seed=3).state_dict()
    for arguments in (args, old):
        got = build_model(arguments, tokenizer()).state_dict()
        assert got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items())


def test_explicit_moe_layers_keep_the_other_ffns_dense(dense):
    model, folder = dense("llama")
    moe = upcycle(folder, num_experts=2, moe_layers=[0])
    assert [layer.is_moe for layer in moe.model.layers] == [True, False]
    torch.testing.assert_close(moe.model.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight, atol=0, rtol=0)
    assert_same_outputs(model, moe)


def test_no_moe_layer_is_an_error(dense):
    _, folder = dense("gpt2")
    with pytest.raises(ValueError, match="no FFN becomes an MoE layer"):
        upcycle(folder, num_experts=4, moe_layer_frequency=3)


def test_output_folder_is_complete_and_sharded(dense, tmp_path):
    model, folder = dense("gpt2")
    out = upcycle(folder, num_experts=4, save_directory=tmp_path / "moe", max_shard_size=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(read_tensors(out)) == set(index["weight_map"])
    assert (out / "modeling_gpt_moe.py").is_file()  # loads with trust_remote_code where hf_ppmoe is absent
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tokenizer().get_vocab()
    assert GenerationConfig.from_pretrained(out).to_dict() == GenerationConfig.from_pretrained(folder).to_dict()
    assert_same_outputs(model, GPTMoEForCausalLM.from_pretrained(out))


def test_model_object_source_carries_the_given_tokenizer(dense, tmp_path):
    model, _ = dense("qwen2")
    out = upcycle(model, num_experts=2, tokenizer=tokenizer(), save_directory=tmp_path / "moe")
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tokenizer().get_vocab()
    assert (out / "generation_config.json").is_file()


def test_dtype_is_kept(dense, tmp_path):
    model, _ = dense("mistral")
    # a copy: the session's model must keep its float32 bits (.to(bfloat16).float() would round them for later tests)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    out = upcycle(tmp_path / "bf16", num_experts=2, router_type="switch", save_directory=tmp_path / "moe")
    assert {t.dtype for t in read_tensors(out).values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_gpt2_checkpoint_without_base_prefix(dense, tmp_path):
    """The original "gpt2" Hub checkpoint was saved from GPT2Model: keys without "transformer.", plus attn.bias."""
    from safetensors.torch import save_file

    model, folder = dense("gpt2")
    (tmp_path / "hub").mkdir()
    tensors = {k.removeprefix("transformer."): v.contiguous() for k, v in read_tensors(folder).items()}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
    save_file(tensors, tmp_path / "hub" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "hub" / "config.json").write_text((folder / "config.json").read_text())
    assert_same_outputs(model, upcycle(tmp_path / "hub", num_experts=4))


def test_expert_output_scale_rejects_gates_without_a_constant_sum(monkeypatch):
    from helpers import tiny_gpt_config

    from hf_ppmoe.moe import GATES, Gate

    class FirstTokenOnly(Gate):  # weight 1 for the first token, 0 for the others
        def select(self, logits):
            T = logits.shape[0]
            ids = torch.zeros(T, 1, dtype=torch.long)
            weights = (torch.arange(T) == 0).float().unsqueeze(1)
            probs = logits.softmax(-1)
            return ids, weights, probs

    monkeypatch.setitem(GATES, "test-first-token-only", FirstTokenOnly)  # registered for this test only
    with pytest.raises(ValueError, match="one positive constant per token"):
        expert_output_scale(tiny_gpt_config(router_type="test-first-token-only"))
