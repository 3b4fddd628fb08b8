"""Seq2Seq-MoE behaves like a Transformers encoder-decoder: cache, padding, labels, losses, generation, saving."""

import subprocess
import sys

import pytest
import torch
from helpers import tiny_seq2seq_config
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from hf_ppmoe import Seq2SeqMoEConfig, Seq2SeqMoEForConditionalGeneration, Seq2SeqMoEModel

GATES = {
    "topk": dict(),
    "switch": dict(router_type="switch", num_experts_per_tok=1),
    "gshard": dict(router_type="gshard", capacity_factor=1.0, eval_capacity_factor=None),
    "prototype": dict(router_type="prototype"),
}


def make_model(gate="topk", **overrides):
    return Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config(**GATES[gate], **overrides)).eval()


def src(batch=2, length=7):
    return torch.randint(3, 97, (batch, length))


@pytest.mark.parametrize("experts_implementation", ["index", "einsum"])
@pytest.mark.parametrize("gate", GATES)
def test_generate_with_cache_equals_without(gate, experts_implementation):
    # a decoder deeper than the encoder: Transformers sizes the generation cache from the encoder's depth
    model = make_model(gate, experts_implementation=experts_implementation, num_decoder_layers=3)
    ids = src()
    kw = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
    encoder_calls = []
    hook = model.model.encoder.register_forward_hook(lambda *args: encoder_calls.append(1))
    with_cache = model.generate(ids, use_cache=True, **kw)
    hook.remove()
    assert len(encoder_calls) == 1  # the encoder output is computed once and reused at every step
    assert torch.equal(with_cache, model.generate(ids, use_cache=False, **kw))
    # incremental decoding (cached self- and cross-attention, reused encoder output) equals a full forward
    full = model(ids, decoder_input_ids=with_cache).logits[:, -1]
    first = model(ids, decoder_input_ids=with_cache[:, :-1], use_cache=True)
    step = model(
        encoder_outputs=(first.encoder_last_hidden_state,),
        decoder_input_ids=with_cache[:, -1:],
        cache=first.cache,
    ).logits[:, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-4)
    cache = first.cache
    assert cache.self_attention_cache.get_seq_length() == with_cache.shape[1]
    assert all(cache.cross_attention_cache.get_seq_length(i) == ids.shape[1] for i in range(3))  # computed once


def test_beam_search_and_sampling():
    model = make_model("gshard")
    ids = src()
    beams = model.generate(ids, max_new_tokens=5, num_beams=3, num_return_sequences=2, eos_token_id=None)
    assert beams.shape == (4, 6)
    # beam search keeps the best greedy-reachable hypothesis at least as likely as greedy's
    greedy = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None)

    def score(seqs, source):
        logp = model(source, decoder_input_ids=seqs[:, :-1]).logits.log_softmax(-1)
        return logp.gather(-1, seqs[:, 1:, None]).sum((1, 2))

    assert (score(beams[::2], ids) >= score(greedy, ids) - 1e-4).all()
    torch.manual_seed(3)
    a = model.generate(ids, max_new_tokens=5, do_sample=True, top_k=10, eos_token_id=None)
    torch.manual_seed(3)
    b = model.generate(ids, max_new_tokens=5, do_sample=True, top_k=10, eos_token_id=None)
    assert a.shape == (2, 6) and torch.equal(a, b)


def test_decoder_start_token_id_is_respected():
    model = make_model(decoder_start_token_id=5)
    out = model.generate(src(), max_new_tokens=3, do_sample=False, eos_token_id=None)
    assert (out[:, 0] == 5).all()
    labels = torch.tensor([[7, 8, 9, -100]])
    assert model._shift_right(labels).tolist() == [[5, 7, 8, 9]]
    with pytest.raises(ValueError, match="needs config.decoder_start_token_id"):
        make_model(decoder_start_token_id=None)(src(1), labels=labels)


def test_labels_become_shifted_decoder_inputs_like_t5():
    model = make_model()
    labels = torch.tensor([[11, 12, 13, 1, -100, -100], [21, 22, 23, 24, 25, 1]])
    shifted = model._shift_right(labels)
    assert shifted.tolist() == [[0, 11, 12, 13, 1, 0], [0, 21, 22, 23, 24, 25]]  # -100 -> pad_token_id (0)
    ids = src()
    a = model(ids, labels=labels)
    b = model(ids, decoder_input_ids=shifted, labels=labels)
    torch.testing.assert_close(a.logits, b.logits)
    torch.testing.assert_close(a.loss, b.loss)
    lm = torch.nn.functional.cross_entropy(a.logits.reshape(-1, 97), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(a.loss, lm + 0.01 * a.aux_loss + 0.001 * a.z_loss)


@pytest.mark.parametrize("side", ["left", "right"])
def test_encoder_padding_changes_neither_outputs_nor_router_losses(side):
    model = make_model("gshard", router_z_loss_coef=0.01)
    ids, labels = src(1, 6), torch.randint(3, 97, (1, 5))
    pad = torch.zeros(1, 4, dtype=torch.long)
    padded = torch.cat([pad, ids], 1) if side == "left" else torch.cat([ids, pad], 1)
    mask = (padded != 0).long()
    real = slice(4, None) if side == "left" else slice(0, 6)
    a = model(ids, labels=labels, output_router_logits=True)
    b = model(padded, attention_mask=mask, labels=labels, output_router_logits=True)
    torch.testing.assert_close(b.encoder_last_hidden_state[:, real], a.encoder_last_hidden_state, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-4)
    for name in ("loss", "aux_loss", "z_loss", "encoder_aux_loss", "encoder_z_loss", "decoder_aux_loss"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), atol=1e-6, rtol=1e-5, msg=name)
    # padding is routed nowhere
    assert (b.encoder_router_expert_ids[0][~mask.bool().reshape(-1)] == model.config.num_experts).all()
    kw = dict(max_new_tokens=5, do_sample=False, eos_token_id=None)
    assert torch.equal(model.generate(padded, attention_mask=mask, **kw), model.generate(ids, **kw))


def test_label_padding_changes_neither_loss_nor_router_losses():
    model = make_model(router_z_loss_coef=0.01)
    ids, labels = src(1), torch.randint(3, 97, (1, 5))
    padded = torch.cat([labels, torch.full((1, 3), -100)], 1)
    a, b = model(ids, labels=labels), model(ids, labels=padded)
    torch.testing.assert_close(b.logits[:, :5], a.logits)
    for name in ("loss", "aux_loss", "z_loss", "decoder_aux_loss", "decoder_z_loss"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), msg=name)
    # a decoder_attention_mask excludes its padding from the router losses too
    mask = torch.tensor([[1] * 5 + [0] * 3])
    c = model(ids, decoder_input_ids=model._shift_right(padded), decoder_attention_mask=mask)
    torch.testing.assert_close(c.decoder_aux_loss, a.decoder_aux_loss)


def test_router_outputs_of_both_stacks_and_the_loss_average_over_all_moe_layers():
    model = make_model(
        num_hidden_layers=4, num_decoder_layers=3, encoder_moe_layer_frequency=2, decoder_moe_layers=[0],
        router_aux_loss_coef=0.5, router_z_loss_coef=0.25,
    )
    assert [layer.is_moe for layer in model.model.encoder.layers] == [False, True, False, True]
    assert [layer.is_moe for layer in model.model.decoder.layers] == [True, False, False]
    ids, labels = src(2, 7), torch.randint(3, 97, (2, 5))
    out = model(ids, labels=labels, output_router_logits=True, output_hidden_states=True)
    assert [t.shape for t in out.encoder_router_logits] == [(14, 4)] * 2
    assert [t.shape for t in out.decoder_router_logits] == [(10, 4)]
    for logits, expert_ids in zip(out.encoder_router_logits + out.decoder_router_logits,
                                  out.encoder_router_expert_ids + out.decoder_router_expert_ids):
        assert torch.equal(expert_ids, logits.topk(2, dim=-1).indices)
    # the routed hidden states are the FFN inputs of those layers
    layer = model.model.encoder.layers[1]
    h = out.encoder_hidden_states[1]
    bias = model.model.encoder.position_bias(7, 7, 0, h.device)
    h = layer.attention_block(h, layer.input_layernorm, layer.self_attn, attention_mask=None, position_bias=bias)
    routing = layer.mlp.gate(layer.post_attention_layernorm(h).reshape(-1, 32))
    torch.testing.assert_close(out.encoder_router_logits[0], routing.router_logits, atol=1e-5, rtol=1e-4)

    aux = (2 * out.encoder_aux_loss + out.decoder_aux_loss) / 3
    z = (2 * out.encoder_z_loss + out.decoder_z_loss) / 3
    torch.testing.assert_close(out.aux_loss, aux)
    torch.testing.assert_close(out.z_loss, z)
    lm = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 97), labels.reshape(-1))
    torch.testing.assert_close(out.loss, lm + 0.5 * aux + 0.25 * z)
    # a dense model reports no router losses and its loss is the LM loss
    dense = make_model(encoder_moe_layers=[], decoder_moe_layers=[])
    out = dense(ids, labels=labels)
    assert out.aux_loss is None and out.encoder_aux_loss is None
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits.reshape(-1, 97), labels.reshape(-1)))


def copy_dense_into_identical_experts(moe_model, dense_model):
    """Every MoE layer of `moe_model` gets E copies of the dense FFN at the same place in `dense_model`."""
    dense_state = dense_model.state_dict()
    with torch.no_grad():
        for name, param in moe_model.named_parameters():
            if name in dense_state:
                param.copy_(dense_state[name])
        for stack in ("encoder", "decoder"):
            for moe_layer, dense_layer in zip(getattr(moe_model.model, stack).layers, getattr(dense_model.model, stack).layers):
                if not moe_layer.is_moe:
                    continue
                mlp, experts = dense_layer.mlp, moe_layer.mlp.experts
                if experts.has_gate:
                    experts.gate_up_proj.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).expand_as(experts.gate_up_proj))
                else:
                    experts.up_proj.copy_(mlp.up_proj.weight.expand_as(experts.up_proj))
                experts.down_proj.copy_(mlp.down_proj.weight.expand_as(experts.down_proj))


@pytest.mark.parametrize("experts_implementation", ["index", "einsum"])
@pytest.mark.parametrize("gate, gated", [("topk", True), ("gshard", False)])
def test_identical_experts_equal_the_dense_model(gate, gated, experts_implementation):
    # both gates' combine weights sum to one (normalised top-k, GShard's g1 + g2), so E copies of one FFN are that FFN
    kw = dict(gated_mlp=gated, hidden_act="gelu_new" if gated else "relu", moe_layer_frequency=2, num_hidden_layers=3)
    dense = make_model(encoder_moe_layers=[], decoder_moe_layers=[], **kw)
    moe = make_model(gate, experts_implementation=experts_implementation, **kw)
    assert moe.model.encoder.num_moe_layers == 1 and moe.model.decoder.num_moe_layers == 1
    with torch.no_grad():
        for p in dense.parameters():  # large weights, so that a wrong expert or weight would show
            p.normal_(0.0, 0.3)
    copy_dense_into_identical_experts(moe, dense)
    ids, labels = src(2, 9), torch.randint(3, 97, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    a, b = moe(ids, attention_mask=mask, labels=labels), dense(ids, attention_mask=mask, labels=labels)
    assert b.logits.abs().max() > 1.0
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(moe.generate(ids, **kw), dense.generate(ids, **kw))


@pytest.mark.parametrize("tied", [False, True])
def test_eager_and_sdpa_agree_and_attentions_are_returned(tied):
    model = make_model(tie_word_embeddings=tied, scale_decoder_outputs=tied)
    assert (model.lm_head.weight is model.model.shared.weight) == tied
    assert model.model.encoder.embed_tokens.weight is model.model.shared.weight is model.model.decoder.embed_tokens.weight
    ids, labels = src(2, 9), torch.randint(3, 97, (2, 5))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    model.set_attn_implementation("sdpa")
    sdpa = model(ids, attention_mask=mask, labels=labels).logits
    model.set_attn_implementation("eager")
    eager = model(ids, attention_mask=mask, labels=labels, output_attentions=True)
    torch.testing.assert_close(eager.logits, sdpa, atol=1e-5, rtol=1e-4)
    assert [a.shape for a in eager.encoder_attentions] == [(2, 4, 9, 9)] * 2
    assert [a.shape for a in eager.cross_attentions] == [(2, 4, 5, 9)] * 2
    assert (eager.cross_attentions[0][0, :, :, 5:] == 0).all()  # padding gets no attention
    assert (eager.decoder_attentions[0][..., 0, 1:] == 0).all()  # causal


def test_gradient_checkpointing_gives_the_same_gradients():
    model = make_model("gshard", hidden_dropout=0.1, router_jitter_noise=0.1).train()
    ids, labels = src(2, 8), torch.randint(3, 97, (2, 5))

    def grads():
        model.zero_grad()
        torch.manual_seed(1)
        model(ids, labels=labels).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.activation_checkpointing_enable()
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys() and "model.decoder.layers.0.mlp.gate.weight" in plain
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], msg=name)


SAVE_AND_COMPARE = """
import sys, torch
{blocker}
from transformers import AutoModelForSeq2SeqLM
model = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1], trust_remote_code={trust}{load_kwargs}).eval()
ids, labels, logits, tokens = torch.load(sys.argv[2])
assert type(model).__module__.startswith({module!r}), type(model).__module__
assert model.lm_head.weight is model.model.shared.weight, "head no longer tied"
assert torch.equal(model(ids, labels=labels).logits, logits), "logits differ"
assert torch.equal(model.generate(ids, max_new_tokens=4, num_beams=2), tokens), "generations differ"
# custom_generate/generate.py is the model's generate: beam search runs flat (one cache row per prompt)
cache = model.generate(ids, max_new_tokens=4, num_beams=2, return_dict_in_generate=True).cache
assert cache.self_attention_cache.layers[0].keys.shape[0] == ids.shape[0], "beam search did not run flat"
print("OK")
"""


def test_save_load_round_trip_in_a_fresh_process_without_hf_ppmoe(tmp_path):
    """Bit-exact logits and generations from the saved folder, loaded with trust_remote_code where hf_ppmoe cannot be
    imported (loading with hf_ppmoe installed: test_auto_classes_and_untied_round_trip)."""
    model = make_model("gshard", tie_word_embeddings=True, scale_decoder_outputs=True, experts_implementation="einsum")
    model.save_pretrained(tmp_path / "ckpt")
    ids, labels = src(), torch.randint(3, 97, (2, 5))
    expected = (ids, labels, model(ids, labels=labels).logits, model.generate(ids, max_new_tokens=4, num_beams=2))
    torch.save(expected, tmp_path / "expected.pt")
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"config.json", "model.safetensors", "modeling_seq2seq_moe.py", "configuration_seq2seq_moe.py",
            "moe_layer.py", "moe_gates.py", "common.py"} <= files
    # the experts' kernel is a run-time choice, as the attention's (not in config.json): asked for again on loading
    script = SAVE_AND_COMPARE.format(
        blocker="sys.modules['hf_ppmoe'] = None  # hf_ppmoe cannot be imported", trust=True, module="transformers_modules",
        load_kwargs=", experts_implementation='einsum'",
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "ckpt"), str(tmp_path / "expected.pt")],
        capture_output=True,
        text=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HF_HOME": str(tmp_path / "hf_home"),
             "OMP_NUM_THREADS": str(torch.get_num_threads())},  # bit-equal logits need the same thread count
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout


def test_auto_classes_and_untied_round_trip(tmp_path):
    model = make_model(num_decoder_layers=3)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert isinstance(AutoConfig.from_pretrained(tmp_path), Seq2SeqMoEConfig)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert isinstance(loaded, Seq2SeqMoEForConditionalGeneration)
    assert loaded.lm_head.weight is not loaded.model.shared.weight
    assert loaded.model.encoder.embed_tokens.weight is loaded.model.shared.weight
    state, loaded_state = model.state_dict(), loaded.state_dict()
    assert state.keys() == loaded_state.keys()
    for name in state:
        assert torch.equal(state[name], loaded_state[name]), name
    ids = src()
    kw = dict(max_new_tokens=4, num_beams=2)
    assert torch.equal(loaded.eval().generate(ids, **kw), model.generate(ids, **kw))
    base = AutoModel.from_pretrained(tmp_path)
    assert isinstance(base, Seq2SeqMoEModel)
    torch.testing.assert_close(
        base.eval()(ids, decoder_input_ids=ids[:, :3]).last_hidden_state,
        model.model(ids, decoder_input_ids=ids[:, :3]).last_hidden_state,
    )


def test_seq2seq_trainer_trains_and_evaluates_with_generate(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        DataCollatorForSeq2Seq,
        PreTrainedTokenizerFast,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
    )

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    words = ["hello world", "mixture of experts", "gshard", "encoder decoder", "switch", "top two gating"]
    rows = [{"input_ids": tok(w)["input_ids"], "labels": tok(w[::-1])["input_ids"]} for w in words]
    model = make_model("gshard").train()
    collator = DataCollatorForSeq2Seq(tok, model=model)
    batch = collator(rows[:2])
    assert torch.equal(batch["decoder_input_ids"], model._shift_right(batch["labels"]))
    assert (batch["labels"] == -100).any()  # label padding
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=3, per_device_eval_batch_size=3, max_steps=4,
        learning_rate=1e-2, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
        predict_with_generate=True, generation_max_length=6,
    )
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=rows, eval_dataset=rows, data_collator=collator)
    before = model.model.encoder.layers[0].mlp.gate.weight.detach().clone()
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(before, model.model.encoder.layers[0].mlp.gate.weight)  # the routers train
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))
    prediction = trainer.predict(rows[:3])
    assert prediction.predictions.shape[0] == 3


def test_labels_that_are_a_non_contiguous_slice():
    model = Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config()).eval()
    ids = torch.randint(3, 97, (2, 10))
    labels = ids[:, :5]  # a view with row stride 10: not contiguous
    assert not labels.is_contiguous()
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, model(input_ids=ids, labels=labels.clone()).loss)
