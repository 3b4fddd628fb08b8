"""Flat beam search (GShard A.5) gives what Transformers' beam search gives, never reorders the cache, and ships
with our checkpoints as `custom_generate/generate.py`."""

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import GPT2_STYLE, tiny_gpt_config, tiny_seq2seq_config
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    DynamicCache,
    EncoderDecoderCache,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.generation import flat_beam_search
from hf_ppmoe.generation.flat_beam_search import _RelativeBias

VOCAB = 24  # small, so that EOS (id 1) is often among the candidates
GATES = {
    "topk": dict(),
    "switch": dict(router_type="switch", num_experts_per_tok=1),
    "gshard": dict(router_type="gshard", capacity_factor=1.0, eval_capacity_factor=None),
    "prototype": dict(router_type="prototype"),
}
DENSE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, bos_token_id=2, eos_token_id=1, pad_token_id=0)
MODELS = {
    **{f"gpt_moe-llama-{g}": lambda g=g: GPTMoEForCausalLM(tiny_gpt_config(vocab_size=VOCAB, **GATES[g])) for g in GATES},
    "gpt_moe-gpt2-topk": lambda: GPTMoEForCausalLM(tiny_gpt_config(vocab_size=VOCAB, **GPT2_STYLE)),
    "gpt_moe-qwen3-topk": lambda: GPTMoEForCausalLM(tiny_gpt_config(vocab_size=VOCAB, qk_norm=True)),  # q/k norms
    "gpt_moe-gpt2-gshard-eager": lambda: GPTMoEForCausalLM._from_config(
        tiny_gpt_config(vocab_size=VOCAB, **GPT2_STYLE, **GATES["gshard"]), attn_implementation="eager"
    ),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**DENSE)),
    "llama-eager": lambda: LlamaForCausalLM._from_config(LlamaConfig(**DENSE), attn_implementation="eager"),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**DENSE, num_local_experts=4, num_experts_per_tok=2)),
}
# (num_beams, length_penalty, early_stopping, num_return_sequences, max_new_tokens, eos_token_id); "likely" is a
# token the model often generates, so that hypotheses do finish before max_new_tokens
CASES = [
    (2, 1.0, False, 1, 10, 1),
    (4, 0.0, "never", 2, 8, "likely"),
    (3, -0.5, True, 3, 10, "likely"),
    (4, 2.0, "never", 4, 6, [1, "likely"]),
    (2, 1.0, True, 2, 12, [1, "likely"]),
    (3, 1.0, False, 1, 7, None),
]


def likely_token(model, ids, mask):
    new = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=None)[:, -4:]
    return int(new[new > 2].mode().values)


def eos_ids(eos, likely):
    return [likely if e == "likely" else e for e in eos] if isinstance(eos, list) else (likely if eos == "likely" else eos)


def padded_batch(vocab=VOCAB):
    ids = torch.randint(3, vocab, (3, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def assert_same_results(reference, flat):
    assert torch.equal(flat.sequences, reference.sequences)
    assert torch.equal(flat.beam_indices, reference.beam_indices)
    torch.testing.assert_close(flat.sequences_scores, reference.sequences_scores, atol=1e-5, rtol=1e-5)
    assert len(flat.scores) == len(reference.scores)
    for a, b in zip(flat.scores, reference.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_flat_equals_transformers_beam_search(name):
    model = MODELS[name]().eval()
    ids, mask = padded_batch()
    likely = likely_token(model, ids, mask)
    finished_early = 0
    for K, lp, es, nrs, new, eos in CASES:
        kw = dict(attention_mask=mask, num_beams=K, length_penalty=lp, early_stopping=es, num_return_sequences=nrs,
                  max_new_tokens=new, eos_token_id=eos_ids(eos, likely), return_dict_in_generate=True, output_scores=True)
        reference = model.generate(ids, **kw)
        flat = model.generate(ids, custom_generate=flat_beam_search, **kw)
        assert_same_results(reference, flat)
        finished_early += int(((flat.beam_indices >= 0).sum(1) < new).sum())
    assert finished_early, "no hypothesis ended before max_new_tokens: EOS handling went untested"


def test_logits_and_scores_per_step_are_those_of_beam_search():
    model = MODELS["gpt_moe-llama-topk"]().eval()
    ids, mask = padded_batch()
    kw = dict(attention_mask=mask, num_beams=3, max_new_tokens=6, return_dict_in_generate=True, output_scores=True,
              output_logits=True, repetition_penalty=1.3)  # a logits processor that reads the running sequences
    reference = model.generate(ids, **kw)
    flat = model.generate(ids, custom_generate=flat_beam_search, **kw)
    assert_same_results(reference, flat)
    for a, b in zip(flat.logits, reference.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_encoder_decoder_t5_relative_position_bias():
    """T5 computes its decoder's relative position bias from cache slots; the flat mask corrects it."""
    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
                      decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
    model = T5ForConditionalGeneration(config).eval()
    ids, mask = padded_batch()
    for attn in ("eager", "sdpa"):
        model.set_attn_implementation(attn)
        for K, lp, es, nrs, new, eos in CASES[:4]:
            kw = dict(attention_mask=mask, num_beams=K, length_penalty=lp, early_stopping=es, num_return_sequences=nrs,
                      max_new_tokens=new, eos_token_id=eos_ids(eos, 3), return_dict_in_generate=True, output_scores=True)
            assert_same_results(model.generate(ids, **kw), model.generate(ids, custom_generate=flat_beam_search, **kw))


def seq2seq_moe(gate, attn="sdpa", **overrides):
    """A tiny Seq2SeqMoE, MoE in every layer of both stacks, with a relative position bias strong enough that a wrong
    bias changes the beams (the default init, std 0.02, hardly matters)."""
    config = tiny_seq2seq_config(vocab_size=VOCAB, **GATES[gate], **overrides)
    model = Seq2SeqMoEForConditionalGeneration._from_config(config, attn_implementation=attn).eval()
    assert model.config._attn_implementation == attn
    assert model.model.encoder.num_moe_layers == model.model.decoder.num_moe_layers == 2
    with torch.no_grad():
        for stack in (model.model.encoder, model.model.decoder):
            stack.relative_attention_bias.weight.normal_(0.0, 2.0)
    return model


SEQ2SEQ_MODELS = {
    **{f"seq2seq_moe-{g}": lambda g=g: seq2seq_moe(g) for g in GATES},
    # T5 v1.0 style (tied, rescaled head), eager attention, einsum experts
    "seq2seq_moe-gshard-eager-tied": lambda: seq2seq_moe("gshard", attn="eager", tie_word_embeddings=True,
                                                         scale_decoder_outputs=True, experts_implementation="einsum"),
}
# decoder positions past relative_attention_max_distance (16) as well
SEQ2SEQ_CASES = CASES + [(3, 1.0, "never", 2, 20, "likely")]


def encoder_batch():
    """Encoder inputs with left padding (row 0) and right padding (row 2)."""
    ids = torch.randint(3, VOCAB, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[2, 4:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def seq2seq_kwargs(mask, case, likely):
    K, lp, es, nrs, new, eos = case
    return dict(attention_mask=mask, num_beams=K, length_penalty=lp, early_stopping=es, num_return_sequences=nrs,
                max_new_tokens=new, eos_token_id=eos_ids(eos, likely), return_dict_in_generate=True, output_scores=True)


@pytest.mark.parametrize("name", SEQ2SEQ_MODELS)
def test_flat_equals_transformers_beam_search_on_seq2seq_moe(name):
    """Seq2SeqMoE's decoder bias is computed from buffer slots; the flat mask corrects it to true positions."""
    model = SEQ2SEQ_MODELS[name]()
    ids, mask = encoder_batch()
    likely = likely_token(model, ids, mask)
    finished_early = 0
    for case in SEQ2SEQ_CASES:
        kw = seq2seq_kwargs(mask, case, likely)
        reference = model.generate(ids, **kw)
        flat = model.generate(ids, custom_generate=flat_beam_search, **kw)
        assert_same_results(reference, flat)
        finished_early += int(((flat.beam_indices >= 0).sum(1) < case[4]).sum())
    assert finished_early, "no hypothesis ended before max_new_tokens: EOS handling went untested"


def test_seq2seq_moe_needs_the_relative_position_bias_correction(monkeypatch):
    """The test above would catch a missing correction: without it, the decoder sees the bias of buffer slots."""
    model = SEQ2SEQ_MODELS["seq2seq_moe-topk"]()
    ids, mask = encoder_batch()
    kw = seq2seq_kwargs(mask, SEQ2SEQ_CASES[-1], likely_token(model, ids, mask))
    reference = model.generate(ids, **kw)
    assert_same_results(reference, model.generate(ids, custom_generate=flat_beam_search, **kw))
    monkeypatch.setattr(_RelativeBias, "correction", lambda self, query_pos, key_pos, *slots: 0.0 * self._bias(
        key_pos[:, None, :] - query_pos[:, :, None]))
    uncorrected = model.generate(ids, custom_generate=flat_beam_search, **kw)
    assert not torch.allclose(uncorrected.sequences_scores, reference.sequences_scores, atol=1e-3)


class AppendOnlyCache(DynamicCache):
    """Fails if a cache row is reordered or any cached key is rewritten: keys may only be appended."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        before = layer.keys.clone() if layer.is_initialized else None
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if before is not None:
            assert torch.equal(keys[..., : before.shape[-2], :], before), "cached keys were rewritten"
        return keys, values

    def reorder_cache(self, beam_idx):
        raise AssertionError("the cache was reordered")


def test_cache_is_only_appended_to():
    model = MODELS["gpt_moe-llama-topk"]().eval()
    ids, mask = padded_batch()
    kw = dict(attention_mask=mask, num_beams=3, max_new_tokens=6, eos_token_id=None)
    with pytest.raises(AssertionError, match="reordered"):  # the check catches ordinary beam search
        model.generate(ids, cache=AppendOnlyCache(config=model.config), **kw)
    cache = AppendOnlyCache(config=model.config)
    out = model.generate(ids, cache=cache, custom_generate=flat_beam_search, return_dict_in_generate=True, **kw)
    assert out.cache is cache
    # one row per prompt (not per beam): the prompt once, then 3 slots for each of the 5 decode steps
    assert cache.layers[0].keys.shape[0] == 3 and cache.get_seq_length() == 6 + 3 * 5
    assert torch.equal(out.sequences, model.generate(ids, **kw))
    assert torch.equal(model.generate(ids, custom_generate=flat_beam_search, **kw), out.sequences)  # a plain tensor


def test_encoder_decoder_cache_is_only_appended_to():
    model = SEQ2SEQ_MODELS["seq2seq_moe-gshard"]()
    ids, mask = encoder_batch()
    kw = dict(attention_mask=mask, num_beams=3, max_new_tokens=6, eos_token_id=None)

    def new_cache():
        return EncoderDecoderCache(AppendOnlyCache(config=model.config), AppendOnlyCache(config=model.config))

    with pytest.raises(AssertionError, match="reordered"):  # the check catches ordinary beam search
        model.generate(ids, cache=new_cache(), **kw)
    cache = new_cache()
    out = model.generate(ids, cache=cache, custom_generate=flat_beam_search, return_dict_in_generate=True,
                         **kw)
    assert out.cache is cache
    # one row per prompt: the decoder start token, then 3 slots for each of the 5 decode steps; the encoder's keys once
    self_layer, cross_layer = cache.self_attention_cache.layers[0], cache.cross_attention_cache.layers[0]
    assert self_layer.keys.shape[0] == 3 and cache.get_seq_length() == 1 + 3 * 5
    assert (cross_layer.keys.shape[0], cross_layer.keys.shape[2]) == (3, ids.shape[1])
    assert torch.equal(out.sequences, model.generate(ids, **kw))


def test_unsupported_settings_raise_clear_errors():
    model = MODELS["gpt_moe-llama-topk"]().eval()
    ids = torch.randint(3, VOCAB, (2, 5))
    for kw, message in [
        (dict(num_beams=1), "greedy"),
        (dict(num_beams=2, do_sample=True), "beam_sample"),
        (dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0), "group_beam_search"),
        (dict(num_beams=2, output_attentions=True, return_dict_in_generate=True), "output_attentions"),
        (dict(num_beams=2, use_cache=False), "use_cache=False"),
        (dict(num_beams=2, cache_implementation="static"), "DynamicCache"),
    ]:
        with pytest.raises(ValueError, match=message):
            model.generate(ids, max_new_tokens=4, custom_generate=flat_beam_search, **kw)
    windowed = GPTMoEForCausalLM(tiny_gpt_config(vocab_size=VOCAB, sliding_window=16)).eval()
    with pytest.raises(ValueError, match="sliding window"):
        windowed.generate(ids, num_beams=4, max_new_tokens=8, custom_generate=flat_beam_search)
    windowed.generate(ids, num_beams=2, max_new_tokens=4, custom_generate=flat_beam_search)  # 5 + 2 * 4 <= 16
    bart = BartForConditionalGeneration(BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
                                                   encoder_attention_heads=2, decoder_attention_heads=2,
                                                   encoder_ffn_dim=16, decoder_ffn_dim=16)).eval()
    with pytest.raises(ValueError, match="positions of flat buffer slots"):
        bart.generate(ids, num_beams=2, max_new_tokens=4, custom_generate=flat_beam_search)


CHECKPOINT_USER = """
import sys, torch
sys.modules['hf_ppmoe'] = None  # hf_ppmoe cannot be imported
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
path = sys.argv[1]
ids, mask, expected = torch.load(sys.argv[2])
kw = dict(attention_mask=mask, num_beams=3, max_new_tokens=6, return_dict_in_generate=True, output_scores=True)

# 1. from_pretrained(trust_remote_code=True) makes custom_generate/generate.py the model's generate
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
out = model.generate(ids, **kw)
assert torch.equal(out.sequences, expected), "sequences differ"
assert out.cache.layers[0].keys.shape[0] == ids.shape[0], "not the flat layout: one cache row per beam"
greedy = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)  # other modes as usual
assert greedy.shape == (ids.shape[0], ids.shape[1] + 3)

# 2. generate(custom_generate=<folder>, trust_remote_code=True) on any causal LM
llama = LlamaForCausalLM(LlamaConfig(vocab_size=24, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, eos_token_id=1, pad_token_id=0)).eval()
reference = llama.generate(ids, **kw)
out = llama.generate(ids, custom_generate=path, trust_remote_code=True, **kw)
assert torch.equal(out.sequences, reference.sequences)
assert out.cache.layers[0].keys.shape[0] == ids.shape[0]
print("OK")
"""


def test_checkpoint_carries_flat_beam_search_for_trust_remote_code(tmp_path):
    model = MODELS["gpt_moe-qwen3-topk"]().eval()  # the flattened modeling code with qk_norm, without hf_ppmoe
    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "custom_generate" / "generate.py").is_file()
    ids, mask = padded_batch()
    expected = model.generate(ids, attention_mask=mask, num_beams=3, max_new_tokens=6)
    torch.save((ids, mask, expected), tmp_path / "inputs.pt")
    result = subprocess.run(
        [sys.executable, "-c", CHECKPOINT_USER, str(tmp_path / "ckpt"), str(tmp_path / "inputs.pt")],
        capture_output=True, text=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HF_HOME": str(tmp_path / "hf_home"),
             "OMP_NUM_THREADS": str(torch.get_num_threads())},  # bit-equal logits need the same thread count
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
