"""generate(output_router_logits=True, return_dict_in_generate=True): per step, every MoE layer's routing."""

import pytest
import torch
from helpers import tiny_gpt_config, tiny_seq2seq_config

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.generation import (
    MoEGenerateBeamDecoderOnlyOutput,
    MoEGenerateBeamEncoderDecoderOutput,
    MoEGenerateDecoderOnlyOutput,
    MoEGenerateEncoderDecoderOutput,
    flat_beam_search,
)

E, P, NEW = 4, 6, 5


def make_model(**overrides):
    # 4 layers, MoE in layers 1 and 3
    return GPTMoEForCausalLM(tiny_gpt_config(num_hidden_layers=4, moe_layer_frequency=2, **overrides)).eval()


def padded_prompts():
    ids = torch.randint(3, 97, (2, P))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


def forward_routing(model, sequences, mask):
    """Router logits / expert ids of one forward over whole sequences: per MoE layer [rows, length, E or k]."""
    mask = torch.cat([mask, mask.new_ones(mask.shape[0], sequences.shape[1] - mask.shape[1])], 1)
    out = model(sequences, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                output_router_logits=True)
    rows, length = sequences.shape
    return ([x.view(rows, length, -1) for x in out.router_logits],
            [x.view(rows, length, -1) for x in out.router_expert_ids])


def assert_steps_match_forward(out, model, mask):
    """Step 0 holds the prompt, step t the token at position P + t - 1 of every row."""
    logits, expert_ids = forward_routing(model, out.sequences[:, :-1], mask)
    steps = len(out.router_logits)
    assert steps == out.sequences.shape[1] - P == len(out.router_expert_ids)
    for t in range(steps):
        positions = slice(0, P) if t == 0 else slice(P + t - 1, P + t)
        assert len(out.router_logits[t]) == len(out.router_expert_ids[t]) == 2  # MoE layers
        for layer in range(2):
            rows = out.sequences.shape[0]
            torch.testing.assert_close(out.router_logits[t][layer],
                                       logits[layer][:, positions].reshape(-1, E), atol=1e-5, rtol=1e-4)
            assert torch.equal(out.router_expert_ids[t][layer], expert_ids[layer][:, positions].reshape(rows * (P if t == 0 else 1), -1))


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_per_step_routing_agrees_with_a_forward_pass(mode):
    model = make_model()
    ids, mask = padded_prompts()
    kw = dict(do_sample=True, top_k=0) if mode == "sample" else dict(do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None, output_router_logits=True,
                         return_dict_in_generate=True, **kw)
    assert isinstance(out, MoEGenerateDecoderOnlyOutput) and out.sequences.shape == (2, P + NEW)
    assert out.router_logits[0][0].shape == (2 * P, E) and out.router_expert_ids[1][0].shape == (2, 2)
    assert_steps_match_forward(out, model, mask)


def test_beam_and_flat_beam_search_report_the_same_running_beams():
    model = make_model()
    ids, mask = padded_prompts()
    K = 3
    kw = dict(attention_mask=mask, num_beams=K, max_new_tokens=NEW, eos_token_id=None, output_router_logits=True,
              return_dict_in_generate=True)
    beam = model.generate(ids, **kw)
    flat = model.generate(ids, custom_generate=flat_beam_search, **kw)
    assert isinstance(beam, MoEGenerateBeamDecoderOnlyOutput) and isinstance(flat, MoEGenerateBeamDecoderOnlyOutput)
    assert torch.equal(beam.sequences, flat.sequences) and len(beam.router_logits) == len(flat.router_logits) == NEW
    # prefill: Transformers runs every prompt K times, flat beam search once
    logits, expert_ids = forward_routing(model, ids, mask)
    for layer in range(2):
        assert beam.router_logits[0][layer].shape == (2 * K * P, E)
        torch.testing.assert_close(flat.router_logits[0][layer], logits[layer].reshape(-1, E), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(beam.router_logits[0][layer].view(2, K, P, E)[:, 0], logits[layer], atol=1e-5,
                                   rtol=1e-4)
        assert torch.equal(flat.router_expert_ids[0][layer], expert_ids[layer].reshape(2 * P, -1))
    # later steps: one row per running beam, in the same order in both layouts
    for t in range(1, NEW):
        for layer in range(2):
            assert flat.router_logits[t][layer].shape == (2 * K, E)
            torch.testing.assert_close(flat.router_logits[t][layer], beam.router_logits[t][layer], atol=1e-5, rtol=1e-4)
            assert torch.equal(flat.router_expert_ids[t][layer], beam.router_expert_ids[t][layer])


def test_router_logits_never_reach_the_forward_and_plain_generate_is_unchanged():
    model = make_model()
    ids, mask = padded_prompts()
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("output_router_logits")), with_kwargs=True)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, output_router_logits=True,
                         return_dict_in_generate=True)
    assert len(seen) == len(out.router_logits) == 3 and not any(seen)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=3)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out.sequences)
    assert len(model._forward_pre_hooks) == 1 and not any(layer.mlp._forward_hooks for layer in model.model.layers)
    with pytest.raises(ValueError, match="return_dict_in_generate"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, output_router_logits=True)


def make_seq2seq_model():
    # encoder: 3 layers, MoE in 0 and 2; decoder: 2 layers, MoE in 1
    config = tiny_seq2seq_config(num_hidden_layers=3, encoder_moe_layers=[0, 2], decoder_moe_layers=[1])
    return Seq2SeqMoEForConditionalGeneration(config).eval()


def seq2seq_forward_routing(model, ids, mask, sequences):
    """Per stack and MoE layer, the routing of one forward: encoder [rows * S, E or k], decoder [rows, length, E or k]."""
    with torch.no_grad():
        out = model(ids, attention_mask=mask, decoder_input_ids=sequences, output_router_logits=True)
    rows, length = sequences.shape
    return (out.encoder_router_logits, out.encoder_router_expert_ids,
            [x.view(rows, length, -1) for x in out.decoder_router_logits],
            [x.view(rows, length, -1) for x in out.decoder_router_expert_ids])


def assert_encoder_routing(out, expected_logits, expected_ids):
    assert len(out.encoder_router_logits) == len(out.encoder_router_expert_ids) == 2
    for got, expected in zip(out.encoder_router_logits, expected_logits):
        assert got.shape == (2 * P, E)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    for got, expected in zip(out.encoder_router_expert_ids, expected_ids):
        assert torch.equal(got, expected)


def test_seq2seq_moe_reports_its_encoder_once_and_its_decoder_per_step():
    model = make_seq2seq_model()
    ids, mask = padded_prompts()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         output_router_logits=True, return_dict_in_generate=True)
    assert isinstance(out, MoEGenerateEncoderDecoderOutput) and out.sequences.shape == (2, 1 + NEW)
    enc_logits, enc_ids, dec_logits, dec_ids = seq2seq_forward_routing(model, ids, mask, out.sequences[:, :-1])
    assert_encoder_routing(out, enc_logits, enc_ids)
    # step t: the decoder token at position t (step 0: the decoder start token) of every row, in the decoder's MoE layer
    assert len(out.router_logits) == len(out.router_expert_ids) == NEW
    for t in range(NEW):
        assert len(out.router_logits[t]) == len(out.router_expert_ids[t]) == 1
        torch.testing.assert_close(out.router_logits[t][0], dec_logits[0][:, t], atol=1e-5, rtol=1e-4)
        assert torch.equal(out.router_expert_ids[t][0], dec_ids[0][:, t])
    # an encoder output passed in: the encoder does not run, so it has no routing to report
    encoder_outputs = model.get_encoder()(ids, attention_mask=mask)
    again = model.generate(encoder_outputs=encoder_outputs, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                           eos_token_id=None, output_router_logits=True, return_dict_in_generate=True)
    assert torch.equal(again.sequences, out.sequences) and len(again.router_logits) == NEW
    assert again.encoder_router_logits is None and again.encoder_router_expert_ids is None


def test_seq2seq_moe_beam_and_flat_beam_search_report_both_stacks():
    model = make_seq2seq_model()
    ids, mask = padded_prompts()
    K = 3
    kw = dict(attention_mask=mask, num_beams=K, max_new_tokens=NEW, eos_token_id=None, output_router_logits=True,
              return_dict_in_generate=True)
    beam = model.generate(ids, **kw)
    flat = model.generate(ids, custom_generate=flat_beam_search, **kw)
    assert isinstance(beam, MoEGenerateBeamEncoderDecoderOutput) and isinstance(flat, MoEGenerateBeamEncoderDecoderOutput)
    assert torch.equal(beam.sequences, flat.sequences)
    enc_logits, enc_ids, dec_logits, _ = seq2seq_forward_routing(model, ids, mask, beam.sequences[:, :1])
    for out in (beam, flat):  # the encoder runs once on the prompts, before they are expanded to K beams
        assert_encoder_routing(out, enc_logits, enc_ids)
    # step 0, the decoder start token: Transformers runs it K times per prompt, flat beam search once
    assert beam.router_logits[0][0].shape == (2 * K, E) and flat.router_logits[0][0].shape == (2, E)
    torch.testing.assert_close(flat.router_logits[0][0], dec_logits[0][:, 0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(beam.router_logits[0][0].view(2, K, E)[:, 0], dec_logits[0][:, 0], atol=1e-5, rtol=1e-4)
    for t in range(1, NEW):  # one row per running beam, in the same order
        torch.testing.assert_close(flat.router_logits[t][0], beam.router_logits[t][0], atol=1e-5, rtol=1e-4)
        assert torch.equal(flat.router_expert_ids[t][0], beam.router_expert_ids[t][0])
