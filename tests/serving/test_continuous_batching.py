"""Transformers' continuous batching (`generate_batch`: paged attention cache, requests packed into one ragged batch)
on GPT-MoE: every request's greedy tokens equal `generate`'s, alone and in a left-padded batch, for dropless and
capacity gates and both position styles. Seq2Seq-MoE refuses it by name (Transformers' continuous batching is
decoder-only)."""

import copy

import pytest
import torch
from helpers import GPT2_STYLE, tiny_gpt_config
from transformers import ContinuousBatchingConfig, GenerationConfig

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration

# mixed lengths: requests of different lengths share every forward of the paged cache
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15, 16], [17, 18, 19, 20, 21]]
NEW_TOKENS = 6
# a small paged cache: Transformers sizes the default one for an accelerator (8192 tokens a batch), slow on a CPU
SMALL_CACHE = dict(num_blocks=16, max_batch_tokens=64, page_size=16)


def greedy(**extra) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None, **extra)


def batch_outputs(model, prompts) -> list[list[int]]:
    out = model.generate_batch(
        prompts,
        generation_config=greedy(),
        continuous_batching_config=ContinuousBatchingConfig(**SMALL_CACHE),
        warmup=False,
    )
    assert len(out) == len(prompts), f"requests failed: {sorted(out)}"
    by_prompt = {tuple(o.prompt_ids): list(o.generated_tokens) for o in out.values()}
    return [by_prompt[tuple(p)] for p in prompts]


def generate_alone(model, prompt) -> list[int]:
    ids = torch.tensor([prompt])
    return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy())[0, len(prompt):].tolist()


def generate_padded(model, prompts) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, generation_config=greedy())
    return out[:, width:].tolist()


GATES = {
    "topk_dropless": dict(router_type="topk"),
    # GShard capacity while training; evaluation is dropless by default, so a request's tokens never depend on others
    "gshard_capacity": dict(router_type="gshard", capacity_factor=1.0),
    "switch_capacity": dict(router_type="switch", num_experts_per_tok=1, capacity_factor=1.25),
    # an evaluation capacity large enough that no route is dropped (C >= every expert's load)
    "topk_eval_capacity": dict(router_type="topk", capacity_factor=1.0, eval_capacity_factor=8.0),
}


@pytest.mark.parametrize("gate", sorted(GATES))
@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_generate_batch_equals_generate(gate, style):
    torch.manual_seed(0)
    config = tiny_gpt_config(**GATES[gate], **(GPT2_STYLE if style == "gpt2" else {}))
    model = GPTMoEForCausalLM(config).eval()
    expected = [generate_alone(model, p) for p in PROMPTS]
    assert batch_outputs(model, PROMPTS) == expected
    assert generate_padded(model, PROMPTS) == expected  # the padded batch of `generate` agrees too


def test_generate_batch_leaves_the_attention_implementation_as_it_was():
    model = GPTMoEForCausalLM(tiny_gpt_config()).eval()
    before = model.config._attn_implementation
    model.generate_batch(PROMPTS[:1], generation_config=greedy(),
                         continuous_batching_config=ContinuousBatchingConfig(**SMALL_CACHE), warmup=False)
    assert model.config._attn_implementation == before  # paged attention only while the manager runs
    assert generate_alone(model, PROMPTS[0]) == batch_outputs(model, PROMPTS[:1])[0]


def test_seq2seq_refuses_continuous_batching_by_name():
    from helpers import tiny_seq2seq_config

    model = Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config()).eval()
    with pytest.raises(NotImplementedError, match="decoder-only"):
        model.generate_batch([[5, 6, 7]], generation_config=greedy())
