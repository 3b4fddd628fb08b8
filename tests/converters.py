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


@functools.cache
def tokenizer():
    return train_tokenizer(builtin_corpus()[:40], vocab_size=300)


def dense_config(arch: str):
    """A tiny config per source architecture; each variant exercises the features that architecture has."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config

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
    if arch == "mixtral":
        return MixtralConfig(**rotary, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(arch)


def build_dense(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(dense_config(arch)).eval()
    # Transformers initialises norms to ones and biases to zeros; random values make the maps' mistakes visible
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name or "ln_" in name else 0.0, 0.1)
    return model


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
