"""Small random source checkpoints for the conversion tests, built by Transformers itself, and the comparisons."""

import functools
from pathlib import Path

import torch
from safetensors import safe_open

from hf_ppmoe.training.data import builtin_corpus, train_tokenizer

SAMPLE_TEXTS = [
    "def add(a, b): return a + b",
    "The for statement iterates over the items of a sequence.",
    "Exceptions are raised by the raise statement.",
    "class Point: x: int; y: int",
]


# gate settings for upcycling tests; the comments give each gate's sum of combine weights at init, 1 / that is the
# expert output scale that keeps an upcycled model equal to its dense source
GATES = {
    "topk": dict(router_type="topk"),
    "topk-unnormalized": dict(router_type="topk", norm_topk_prob=False),  # weights sum to K/E = 1/2
    "topk-m6t": dict(router_type="topk", topk_weighting="m6t"),  # M6-T Eq. (1): a softmax over the k, sums to 1
    "switch": dict(router_type="switch"),  # 1/E = 1/4
    "gshard": dict(router_type="gshard", capacity_factor=1.25),  # capacity in training only: evaluation is dropless
    "prototype": dict(router_type="prototype", num_experts_per_tok=4, num_experts=8),  # 4 prototypes: 4 * 1/2 = 2
}


@functools.cache
def tokenizer():
    return train_tokenizer(builtin_corpus()[:40], vocab_size=300)


def dense_config(arch: str):
    """A tiny config per source architecture; each variant exercises the features that architecture has."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    vocab = len(tokenizer())
    tokens = dict(bos_token_id=1, eos_token_id=1, pad_token_id=0)
    rotary = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, **tokens)
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64, layer_norm_epsilon=1e-4, **tokens)
    if arch == "llama":  # every optional feature at once: q/k/v/o and MLP biases, tied head, head_dim != H / heads
        return LlamaConfig(**rotary, attention_bias=True, mlp_bias=True, tie_word_embeddings=True, head_dim=16)
    if arch == "mistral":  # a window shorter than the test sequences, so it matters
        return MistralConfig(**rotary, sliding_window=4)
    if arch == "qwen2":  # q/k/v biases, no o bias
        return Qwen2Config(**rotary)
    # Qwen3: per-head q/k RMSNorm, biases on q/k/v/o, head_dim != H / heads (its default, 128, is not used), a window
    # on every layer shorter than the test sequences
    qwen3 = dict(rotary, head_dim=16, attention_bias=True, use_sliding_window=True, sliding_window=4)
    if arch == "qwen3":
        return Qwen3Config(**qwen3, max_window_layers=0)
    if arch == "mixtral":
        return MixtralConfig(**rotary, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen3_moe":  # layer 0 dense (mlp_only_layers), layers 1-2 MoE with smaller experts, weights not renormalised
        return Qwen3MoeConfig(**(qwen3 | dict(num_hidden_layers=3)), num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=24, mlp_only_layers=[0], norm_topk_prob=False)
    if arch == "glm4_moe":  # layer 0 dense; 4 groups of 2 experts, the best 2 groups; a shared expert; q/k/v biases
        from transformers import Glm4MoeConfig

        return Glm4MoeConfig(**(rotary | dict(num_hidden_layers=3)), head_dim=16, moe_intermediate_size=24,
                             n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2,
                             routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
                             attention_bias=True, use_qk_norm=True, num_mtp_layers=0,
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0))
    raise ValueError(arch)


def build_dense(arch: str, seed: int = 0, **overrides):
    """A tiny random model of `arch`: a name of `dense_config` (with `overrides` of its config fields), "t5-v1.0",
    "t5-v1.1" or "switch"."""
    from transformers import AutoModelForCausalLM

    if arch.startswith("t5-"):
        return tiny_t5(arch.removeprefix("t5-"), seed=seed)
    if arch == "switch":
        return tiny_switch(seed=seed)
    torch.manual_seed(seed)
    config = dense_config(arch)
    for name, value in overrides.items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_config(config).eval()
    # Transformers initialises norms to ones and biases to zeros; random values make the maps' mistakes visible
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name or "ln_" in name else 0.0, 0.1)
    return model


T5_VERSIONS = {
    # v1.0: ReLU FFN, head tied to the embeddings and fed decoder_output * d_model**-0.5
    "v1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    # v1.1: gated GELU, untied head, no rescaling
    "v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}
# encoder and decoder of different depths; sequences longer than max_distance; d_kv * heads != d_model
_T5_SIZES = dict(d_model=32, d_kv=12, d_ff=56, num_layers=3, num_decoder_layers=2, num_heads=3,
                 relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.1,
                 decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)


def _widen(model):
    """T5's init keeps activations tiny; widen it so that every weight matters in the logits (not further: wider
    weights amplify float rounding, e.g. of top-k weights that sum to one, past the 1e-4 the tests allow)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.2) if "layer_norm" in name else p.normal_(0.0, 1.0 if name == "shared.weight" else 0.2)
    return model.eval()


def tiny_t5(version: str, attn: str = "sdpa", seed: int = 0, **overrides):
    from torch import nn
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(**(dict(vocab_size=len(tokenizer()), **_T5_SIZES, **T5_VERSIONS[version]) | overrides))
    model = T5ForConditionalGeneration(config)
    model.set_attn_implementation(attn)
    _widen(model)
    if version == "v1.1":
        # Transformers 5 ties T5's head even for v1.1 configs (real v1.1 checkpoints load untied): untie it
        model.lm_head.weight = nn.Parameter(torch.randn_like(model.shared.weight) * 0.5)
    return model


def tiny_switch(seed: int = 0, tie_word_embeddings: bool = True, **overrides):
    """A Switch Transformers model: 4 experts, sparse blocks 1 of the encoder (3 blocks) and of the decoder (2),
    an expert capacity no test sequence reaches (Switch drops tokens past it, our import is dropless)."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    torch.manual_seed(seed)
    switch = dict(num_experts=4, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, expert_capacity=64,
                  router_jitter_noise=0.0, dense_act_fn="relu", tie_word_embeddings=tie_word_embeddings)
    config = SwitchTransformersConfig(**(dict(vocab_size=len(tokenizer()), **_T5_SIZES, **switch) | overrides))
    model = _widen(SwitchTransformersForConditionalGeneration(config))
    if not tie_word_embeddings:  # Transformers 5 then unties the stacks' embeddings too; ours share one
        model.encoder.embed_tokens.weight = model.decoder.embed_tokens.weight = model.shared.weight
    return model


def seq2seq_inputs(batch: int = 2, source: int = 24, target: int = 22, seed: int = 1) -> dict:
    """Encoder ids with padding on both sides, and decoder ids: sequences longer than max_distance."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, len(tokenizer()), (batch, source), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    mask[-1, :3] = 0
    decoder_ids = torch.randint(3, len(tokenizer()), (batch, target), generator=g)
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)


def assert_same_seq2seq_outputs(reference, model, inputs=None, new_tokens: int = 8):
    """Logits equal (atol 1e-4, float32) and greedy generation gives the same tokens (padded encoder inputs)."""
    inputs = seq2seq_inputs() if inputs is None else inputs
    with torch.no_grad():
        expected = reference(**inputs).logits
        assert expected.abs().max() > 1.0  # not a degenerate model
        torch.testing.assert_close(model(**inputs).logits, expected, atol=1e-4, rtol=0)
    kw = dict(attention_mask=inputs["attention_mask"], max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    assert torch.equal(model.generate(inputs["input_ids"], **kw), reference.generate(inputs["input_ids"], **kw))


def save_dense(model, folder: Path) -> Path:
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def input_ids(batch: int = 2, length: int = 10, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, len(tokenizer()), (batch, length), generator=g)


def assert_same_outputs(reference, model, ids=None, new_tokens: int = 8):
    """Logits equal (atol 1e-4, float32) and greedy generation gives the same tokens."""
    ids = input_ids() if ids is None else ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-4, rtol=0)
    kw = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), reference.generate(ids, **kw))


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out
