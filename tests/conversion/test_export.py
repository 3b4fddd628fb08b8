"""Export to Transformers' own MoE classes (`export_moe`, `hf-ppmoe export`): every fitting config gives the
target's logits and greedy tokens, loads without hf_ppmoe, and imports back bit for bit where an import exists;
everything else is refused with every reason. Also: folders written by upcycle / import_moe carry custom_generate."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from converters import assert_same_outputs, build_dense, input_ids, read_tensors, tiny_switch
from helpers import tiny_gpt_config, tiny_seq2seq_config
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    Glm4MoeForCausalLM,
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
    SwitchTransformersForConditionalGeneration,
)

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe_cli import main
from hf_ppmoe.conversion import ConversionError, export_moe, export_reasons, import_moe, merge_experts, upcycle
from hf_ppmoe.modeling.hub_io import write_custom_generate

VOCAB = 97
LLAMA = dict(router_z_loss_coef=0.0)  # GPT-MoE defaults are Llama-style: rotary, RMSNorm, gated, no biases
# every config the decoder targets can hold, each exercising what its target has: (target, our config, class)
DECODERS = {
    "mixtral": ("mixtral", dict(LLAMA, head_dim=16, sliding_window=4), MixtralForCausalLM),
    "mixtral-gshard-tied": ("mixtral", dict(LLAMA, router_type="gshard", router_random_routing=False,
                                            tie_word_embeddings=True, num_hidden_layers=3), MixtralForCausalLM),
    "mixtral-top1": ("mixtral", dict(LLAMA, num_experts_per_tok=1, topk_weighting="m6t"), MixtralForCausalLM),
    "qwen2_moe-shared": ("qwen2_moe", dict(LLAMA, moe_layer_frequency=2, num_hidden_layers=4, num_experts=8,
                                           num_experts_per_tok=3, shared_expert_intermediate_size=40,
                                           moe_intermediate_size=24, norm_topk_prob=False, attention_bias=True,
                                           attention_output_bias=False, sliding_window=4), Qwen2MoeForCausalLM),
    "qwen2_moe-switch": ("qwen2_moe", dict(LLAMA, router_type="switch", num_experts_per_tok=1, moe_layers=[0, 2],
                                           num_hidden_layers=3, tie_word_embeddings=True), Qwen2MoeForCausalLM),
    "qwen2_moe-prototype": ("qwen2_moe", dict(LLAMA, router_type="prototype", num_experts_per_tok=1,
                                              moe_layer_frequency=2), Qwen2MoeForCausalLM),
    # Qwen3's per-head q/k norms; biases on q/k/v/o; dense layers 0 and 2 (decoder_sparse_step 2), experts smaller
    "qwen3_moe": ("qwen3_moe", dict(LLAMA, qk_norm=True, num_hidden_layers=3, moe_layer_frequency=2, num_experts=8,
                                    num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=False,
                                    attention_bias=True, head_dim=16, sliding_window=4), Qwen3MoeForCausalLM),
    # a dense layer between MoE layers (mlp_only_layers), renormalised top-2, tied head
    "qwen3_moe-gshard-tied": ("qwen3_moe", dict(LLAMA, qk_norm=True, router_type="gshard", router_random_routing=False,
                                                num_hidden_layers=3, moe_layers=[0, 2], tie_word_embeddings=True),
                              Qwen3MoeForCausalLM),
    # DeepSeek-V3 routing: sigmoid scores, a selection bias (random, see `_random`), the best 2 of 4 groups of 2,
    # scaled weights; dense layer 0 (first_k_dense_replace), a shared expert of two expert widths, q/k/v biases
    "glm4_moe": ("glm4_moe", dict(LLAMA, router_score_function="sigmoid", router_expert_bias=True, num_expert_groups=4,
                                  topk_expert_groups=2, routed_scaling_factor=2.5, num_experts=8, num_experts_per_tok=3,
                                  num_hidden_layers=3, moe_layers=[1, 2], moe_intermediate_size=16,
                                  shared_expert_intermediate_size=32, attention_bias=True, attention_output_bias=False,
                                  qk_norm=True, head_dim=16), Glm4MoeForCausalLM),
    # no selection bias (zeros), no shared expert (width 0), every layer MoE, weights not renormalised, tied head
    "glm4_moe-plain": ("glm4_moe", dict(LLAMA, router_score_function="sigmoid", norm_topk_prob=False,
                                        tie_word_embeddings=True), Glm4MoeForCausalLM),
}
# Seq2Seq-MoE in Switch Transformers' layout: T5 v1.0 (ReLU, no gate, q.k unscaled), top-1 by probability, no dropout
SWITCH_LAYOUT = dict(router_type="switch", num_experts_per_tok=1, gated_mlp=False, hidden_act="relu",
                     attention_scaling=1.0, num_hidden_layers=3, num_decoder_layers=2)
SEQ2SEQ = {
    "switch-tied": dict(SWITCH_LAYOUT, tie_word_embeddings=True, scale_decoder_outputs=True, moe_layer_frequency=2),
    "switch-untied": dict(SWITCH_LAYOUT, router_type="topk", norm_topk_prob=False, encoder_moe_layers=[0, 1, 2],
                          decoder_moe_layers=[1]),
    "switch-untied-rescaled": dict(SWITCH_LAYOUT, scale_decoder_outputs=True, moe_layer_frequency=1),
}


def _random(model):
    """Norms and biases away from 1 and 0, decisive routers, and weights large enough that every one shows in the
    logits: a wrong map cannot hide."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
            else:
                p.normal_(0.0, 1.0 if name.endswith("gate.weight") or any(k in name for k in ("embed", "shared", "lm_head")) else 0.2)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):  # of the order of the sigmoid scores: it changes which experts are chosen
                b.normal_(0.0, 0.5)
    return model.eval()


def _ours(case: str):
    torch.manual_seed(0)
    if case in SEQ2SEQ:
        return _random(Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config(**SEQ2SEQ[case])))
    return _random(GPTMoEForCausalLM(tiny_gpt_config(**DECODERS[case][1])))


def _inputs(seq2seq: bool) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    if not seq2seq:
        return dict(input_ids=ids, attention_mask=mask)
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.randint(3, VOCAB, (2, 9), generator=g))


def _assert_same(ours, theirs, seq2seq: bool):
    """Equal logits (a decoder's at real tokens: ours does not route padding, whose outputs nothing reads) and equal
    greedy tokens."""
    inputs = _inputs(seq2seq)
    real = slice(None) if seq2seq else inputs["attention_mask"].bool()
    with torch.no_grad():
        expected = ours(**inputs).logits[real]
        assert expected.abs().max() > 1.0  # not a degenerate model
        torch.testing.assert_close(theirs(**inputs).logits[real], expected, atol=1e-4, rtol=0)
    kw = dict(attention_mask=inputs["attention_mask"], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(theirs.generate(inputs["input_ids"], **kw), ours.generate(inputs["input_ids"], **kw))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """case -> (our model, exported folder), each exported once."""
    cache = {}

    def get(case):
        if case not in cache:
            ours = _ours(case)
            to = "switch_transformers" if case in SEQ2SEQ else DECODERS[case][0]
            cache[case] = (ours, export_moe(ours, tmp_path_factory.mktemp(case) / "out", to=to))
        return cache[case]

    return get


@pytest.mark.parametrize("case", DECODERS)
def test_exported_decoder_equals_ours(exported, case):
    to, _, native = DECODERS[case]
    ours, folder = exported(case)
    theirs = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(theirs) is native
    _assert_same(ours, theirs, seq2seq=False)
    # the Hub layout (one tensor per expert), which the imports (Mixtral, Qwen3-MoE) read back bit for bit
    expert = ".block_sparse_moe.experts.3.w2.weight" if to == "mixtral" else ".mlp.experts.3.down_proj.weight"
    assert any(name.endswith(expert) for name in read_tensors(folder))
    if to in ("mixtral", "qwen3_moe", "glm4_moe"):
        back = import_moe(folder).state_dict()
        if to == "glm4_moe" and not ours.config.router_expert_bias:  # a GLM-4-MoE always has one: zeros here
            assert not any(back.pop(k).any() for k in [k for k in back if k.endswith("gate.expert_bias")])
        assert back.keys() == ours.state_dict().keys()
        assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


@pytest.mark.parametrize("case", SEQ2SEQ)
def test_exported_seq2seq_equals_ours(exported, case):
    ours, folder = exported(case)
    theirs = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    assert type(theirs) is SwitchTransformersForConditionalGeneration
    assert [b.is_sparse for b in theirs.encoder.block] == [layer.is_moe for layer in ours.model.encoder.layers]
    assert [b.is_sparse for b in theirs.decoder.block] == [layer.is_moe for layer in ours.model.decoder.layers]
    _assert_same(ours, theirs, seq2seq=True)
    back = import_moe(folder).state_dict()
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


def test_qwen3_moe_import_equals_it_and_exports_back_to_the_same_checkpoint(dense, tmp_path):
    qwen3_moe, folder = dense("qwen3_moe")
    imported = import_moe(folder)
    config = imported.config
    assert config.qk_norm and config.moe_layers == [1, 2] and config.moe_intermediate_size == 24
    assert config.router_type == "topk" and not config.norm_topk_prob and config.sliding_window == 4
    assert_same_outputs(qwen3_moe, imported)
    out = export_moe(imported, tmp_path / "back", to="qwen3_moe")
    original, back = read_tensors(folder), read_tensors(out)
    assert back.keys() == original.keys() and all(torch.equal(back[k], v) for k, v in original.items())
    # no dense Qwen3 holds both FFN sizes
    with pytest.raises(ConversionError, match=r"dense layers \(intermediate_size=48\) and experts \(moe_intermediate"):
        merge_experts(imported)


def test_qwen3_moe_of_identical_experts_merges_into_the_qwen3_it_computes():
    """The dense twin of an imported Qwen3-MoE (head_dim, q/k norms, biases, window): with every expert a copy of one
    FFN and renormalised weights, the Qwen3-MoE computes that FFN, and the merged Qwen3ForCausalLM computes it too."""
    moe = build_dense("qwen3_moe", mlp_only_layers=[], norm_topk_prob=True)
    with torch.no_grad():
        for layer in moe.model.layers:
            for weight in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                weight.copy_(weight[:1].expand_as(weight))
    merged = merge_experts(import_moe(moe))
    assert type(merged).__name__ == "Qwen3ForCausalLM"
    assert_same_outputs(moe, merged)


def test_switch_import_then_export_gives_the_same_checkpoint(tmp_path):
    switch = tiny_switch(dropout_rate=0.0)
    switch.save_pretrained(tmp_path / "switch")
    out = export_moe(import_moe(tmp_path / "switch"), tmp_path / "back", to="switch_transformers")
    original, back = read_tensors(tmp_path / "switch"), read_tensors(out)
    assert back.keys() == original.keys() and all(torch.equal(back[k], v) for k, v in original.items())


def test_glm4_moe_import_equals_it_and_exports_back_to_the_same_checkpoint(tmp_path):
    glm = build_dense("glm4_moe")
    with torch.no_grad():
        for layer in glm.model.layers[1:]:  # decisive routers, a bias that changes the choice
            layer.mlp.gate.weight.normal_(0.0, 1.0)
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.5)
    glm.save_pretrained(tmp_path / "glm")
    imported = import_moe(tmp_path / "glm")
    config = imported.config
    assert config.router_score_function == "sigmoid" and config.router_expert_bias and config.moe_layers == [1, 2]
    assert (config.num_expert_groups, config.topk_expert_groups, config.routed_scaling_factor) == (4, 2, 2.5)
    assert config.shared_expert_intermediate_size == 24 and config.qk_norm and not config.attention_output_bias
    ids = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(imported(ids).logits, glm(ids).logits, atol=1e-5, rtol=0)
    assert_same_outputs(glm, imported)
    out = export_moe(imported, tmp_path / "back", to="glm4_moe")
    original, back = read_tensors(tmp_path / "glm"), read_tensors(out)
    assert back.keys() == original.keys() and all(torch.equal(back[k], v) for k, v in original.items())
    with pytest.raises(ConversionError, match="imported from a glm4_moe checkpoint that has no dense twin"):
        merge_experts(imported)
    # GLM-4.5's half-rotated heads: ours rotates the whole head
    half = build_dense("glm4_moe", rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5))
    with pytest.raises(ConversionError, match=r"partial_rotary_factor=0.5 \(rope_parameters\) is not supported"):
        import_moe(half)


LOAD_WITHOUT_HF_PPMOE = """
import sys, torch
sys.modules['hf_ppmoe'] = None  # hf_ppmoe cannot be imported
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
for folder, inputs, expected in torch.load(sys.argv[1]):
    auto = AutoModelForSeq2SeqLM if "decoder_input_ids" in inputs else AutoModelForCausalLM
    model = auto.from_pretrained(folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, expected, atol=1e-4, rtol=0)
    print("OK", type(model).__name__)
"""


def test_exported_folders_load_without_hf_ppmoe(exported, tmp_path):
    cases = []
    for case in ("mixtral", "qwen2_moe-shared", "qwen3_moe", "glm4_moe", "switch-tied"):
        ours, folder = exported(case)
        inputs = _inputs(case in SEQ2SEQ)
        inputs.pop("attention_mask")  # no padding: every position is compared
        with torch.no_grad():
            cases.append((str(folder), inputs, ours(**inputs).logits))
        assert not any(p.suffix == ".py" for p in folder.iterdir())  # nothing but Transformers' own code
    torch.save(cases, tmp_path / "cases.pt")
    result = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_HF_PPMOE, str(tmp_path / "cases.pt")], capture_output=True, text=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HF_HOME": str(tmp_path / "hf_home"), "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("OK")]
    assert loaded == ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM",
                      "SwitchTransformersForConditionalGeneration"]


# ------------------------------------------------------------------------------------------------- refusals

GPT2_MOE = dict(position_embedding_type="learned", norm_type="layernorm", gated_mlp=False, hidden_act="gelu_new",
                attention_bias=True, mlp_bias=True, hidden_dropout=0.1, router_type="gshard", capacity_factor=1.0,
                eval_capacity_factor=2.0, router_jitter_noise=0.1, moe_layer_frequency=2,
                shared_expert_intermediate_size=8)
REFUSED = {  # target: (config, a fragment of each reason, in order)
    "mixtral": (tiny_gpt_config(**GPT2_MOE), [
        "router_type='gshard' drops the second expert at random", "layers [0] are dense FFNs", "a shared expert",
        "capacity_factor=1.0", "eval_capacity_factor=2.0", "router_jitter_noise=0.1", "learned absolute positions",
        "norm_type='layernorm'", "a plain MLP", "FFN biases", "attention biases", "hidden_dropout=0.1"]),
    "qwen2_moe": (tiny_gpt_config(**GPT2_MOE), [
        "router_type='gshard' drops the second expert at random", "capacity_factor=1.0", "eval_capacity_factor=2.0",
        "router_jitter_noise=0.1: ours jitters only the router's input; Qwen2-MoE has no jitter",
        "learned absolute positions", "norm_type='layernorm'", "a plain MLP", "FFN biases", "an o_proj bias",
        "hidden_dropout=0.1"]),
    "qwen3_moe": (tiny_gpt_config(**GPT2_MOE), [
        "router_type='gshard' drops the second expert at random", "a shared expert", "capacity_factor=1.0",
        "eval_capacity_factor=2.0", "router_jitter_noise=0.1: ours jitters only the router's input; Qwen3-MoE has no "
        "jitter", "no per-head q/k norm (qk_norm=False)", "learned absolute positions", "norm_type='layernorm'",
        "a plain MLP", "FFN biases", "hidden_dropout=0.1"]),
    "glm4_moe": (tiny_gpt_config(**GPT2_MOE), [
        "router_type='gshard' drops the second expert at random", "router_score_function='softmax'; GLM-4-MoE scores",
        "shared_expert_intermediate_size=8 is not a multiple of the expert size 48", "capacity_factor=1.0",
        "eval_capacity_factor=2.0", "router_jitter_noise=0.1: ours jitters only the router's input; GLM-4-MoE has no "
        "jitter", "learned absolute positions", "norm_type='layernorm'", "a plain MLP", "FFN biases", "an o_proj bias",
        "hidden_dropout=0.1"]),
    "switch_transformers": (tiny_seq2seq_config(
        norm_type="layernorm", attention_bias=True, hidden_dropout=0.1, shared_expert_intermediate_size=8,
        moe_intermediate_size=24, tie_word_embeddings=True, encoder_moe_layers=[0], capacity_factor=1.0,
        router_jitter_noise=0.1), [
        "num_experts_per_tok=2; Switch Transformers routes every token to one expert",
        "encoder MoE layers [0] of 2", "a gated FFN", "norm_type='layernorm'", "attention_scaling=None",
        "biases (attention_bias=True", "dropout (hidden_dropout=0.1", "a shared expert", "moe_intermediate_size=24",
        "a head tied to the embeddings without the d_model**-0.5 rescaling", "capacity_factor=1.0",
        "router_jitter_noise=0.1"]),
}


@pytest.mark.parametrize("to", REFUSED)
def test_every_reason_is_listed_and_nothing_is_written(tmp_path, to):
    config, fragments = REFUSED[to]
    reasons = export_reasons(config, to)
    assert len(reasons) == len(fragments)
    for reason, fragment in zip(reasons, fragments):
        assert fragment in reason
    model_class = GPTMoEForCausalLM if to != "switch_transformers" else Seq2SeqMoEForConditionalGeneration
    model_class(config).save_pretrained(tmp_path / "ours")
    with pytest.raises(ConversionError, match="cannot be exported to") as refused:
        export_moe(tmp_path / "ours", tmp_path / "out", to=to)
    assert all(reason in str(refused.value) for reason in reasons)
    assert not (tmp_path / "out").exists()


def test_gates_are_mapped_by_what_they_compute():
    def reasons(to, **kw):
        return export_reasons(tiny_gpt_config(router_z_loss_coef=0.0, **kw), to)

    assert reasons("mixtral", norm_topk_prob=False) == [
        "the gate weights experts by their softmax probabilities (norm_topk_prob=False); Mixtral always renormalises "
        "the top-k weights to sum to one"]
    assert "router_type='switch'" in reasons("mixtral", router_type="switch", num_experts_per_tok=1)[0]
    assert "topk_weighting='m6t' weights the 2 experts" in reasons("qwen2_moe", topk_weighting="m6t")[0]
    assert "router_type='prototype' routes top-1 within each of 2 prototypes" in reasons("qwen2_moe", router_type="prototype")[0]
    assert reasons("qwen2_moe", router_type="prototype", num_experts_per_tok=1) == []  # one prototype: a top-1 router
    assert reasons("qwen2_moe", norm_topk_prob=False) == reasons("mixtral", router_type="gshard", router_random_routing=False) == []
    # Qwen3-MoE needs Qwen3's per-head q/k norms (qk_norm), which Mixtral and Qwen2-MoE do not have
    assert [r[:40] for r in reasons("qwen3_moe")] == ["no per-head q/k norm (qk_norm=False); Qw"]
    assert reasons("qwen3_moe", qk_norm=True, norm_topk_prob=False) == []
    assert reasons("mixtral", qk_norm=True) == [
        "per-head q/k RMSNorm (qk_norm=True); Mixtral's attention has none (qwen3_moe has it)"]
    assert "Qwen3-MoE has biases on all of q, k, v, o or on none" in reasons(
        "qwen3_moe", qk_norm=True, attention_bias=True, attention_output_bias=False)[0]
    # GLM-4-MoE: sigmoid scores, groups of two or more experts, dense layers only before the MoE layers, no window
    sigmoid = dict(router_score_function="sigmoid", num_experts=8)
    assert reasons("glm4_moe", **sigmoid, num_expert_groups=8, topk_expert_groups=4) == [
        "num_expert_groups=8 makes groups of one expert; GLM-4-MoE scores a group by the sum of its two best experts, "
        "so a group needs 2 or more"]
    assert reasons("glm4_moe", **sigmoid, moe_layers=[0]) == [
        "MoE layers [0] of 2; GLM-4-MoE's first first_k_dense_replace layers are dense and every later one is MoE"]
    assert reasons("glm4_moe", **sigmoid, sliding_window=4) == [
        "sliding_window=4; GLM-4-MoE attends to every earlier position"]
    assert reasons("glm4_moe", **sigmoid, moe_layers=[1], qk_norm=True, topk_weighting="m6t", num_experts_per_tok=1) == []
    one_route = tiny_seq2seq_config(**dict(SWITCH_LAYOUT, router_type="topk"))  # norm_topk_prob: weight 1
    assert export_reasons(one_route, "switch_transformers") == [
        "the one route's weight is renormalised to 1 (router_type='topk'); Switch Transformers weights the expert by "
        "its probability"]
    assert "targets for gpt_moe: mixtral, qwen2_moe, qwen3_moe" in reasons("switch_transformers")[0]
    with pytest.raises(ConversionError, match="unknown export target 'llama'; choose one of mixtral"):
        export_reasons(tiny_gpt_config(), "llama")


def test_the_router_z_loss_that_the_target_lacks_is_named():
    with pytest.warns(UserWarning, match="router_z_loss_coef=0.001 is not exported: MixtralForCausalLM has no router"):
        export_moe(GPTMoEForCausalLM(tiny_gpt_config(router_z_loss_coef=0.001)), to="mixtral")


def test_cli_export(exported, tmp_path, capsys):
    ours, _ = exported("mixtral")
    ours.save_pretrained(tmp_path / "ours")
    assert main(["export", str(tmp_path / "ours"), str(tmp_path / "out"), "--to", "qwen2_moe", "--max_shard_size", "30KB"]) == 0
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    _assert_same(ours, AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), seq2seq=False)
    refused = tmp_path / "refused"
    GPTMoEForCausalLM(tiny_gpt_config(moe_layer_frequency=2, capacity_factor=1.0)).save_pretrained(refused)
    assert main(["export", str(refused), str(tmp_path / "out2"), "--to", "mixtral"]) != 0
    err = capsys.readouterr().err
    assert "cannot be exported to MixtralForCausalLM exactly" in err and "layers [0] are dense" in err
    assert "capacity_factor=1.0" in err and not (tmp_path / "out2").exists()
    glm, _ = exported("glm4_moe")
    glm.save_pretrained(tmp_path / "glm")
    assert main(["export", str(tmp_path / "glm"), str(tmp_path / "glm-out"), "--to", "glm4_moe"]) == 0
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "glm-out")) is Glm4MoeForCausalLM


# ---------------------------------------------------------------------------------------- custom_generate


def test_converted_folders_carry_flat_beam_search(dense, tmp_path):
    write_custom_generate(tmp_path)  # what save_pretrained writes
    flat = (tmp_path / "custom_generate" / "generate.py").read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folders = [upcycle(dense("llama")[1], num_experts=4, save_directory=tmp_path / "upcycled"),
                   import_moe(dense("mixtral")[1], save_directory=tmp_path / "imported")]
    ids = input_ids(length=5)
    kw = dict(num_beams=2, max_new_tokens=4, eos_token_id=None, pad_token_id=0)
    for folder in folders:
        assert (Path(folder) / "custom_generate" / "generate.py").read_text() == flat
        model = GPTMoEForCausalLM.from_pretrained(folder).eval()
        out = model.generate(ids, custom_generate=str(folder), trust_remote_code=True, **kw)
        assert torch.equal(out, model.generate(ids, **kw))
