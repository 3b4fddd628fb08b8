"""Off the CPU the model never reads the device from the host where the capability table says it does not: both
families train (forward+backward, every gate) and take a decoding step on PyTorch's `meta` device, where every host
read (`.item()`, `.tolist()`, `bool(tensor)`, `nonzero`) raises, taking the implementations a GPU takes."""

from unittest import mock

import pytest
import torch
import transformers.masking_utils as masking_utils
from helpers import GPT2_STYLE, tiny_gpt_config, tiny_seq2seq_config
from torch.utils._python_dispatch import TorchDispatchMode

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.moe import MoELayer
from hf_ppmoe.moe import experts as experts_module

GATES = {
    "topk": dict(router_type="topk"),
    "topk-capacity": dict(router_type="topk", capacity_factor=1.0),
    "switch-capacity": dict(router_type="switch", num_experts_per_tok=1, capacity_factor=1.0, router_jitter_noise=0.1),
    "gshard": dict(router_type="gshard", capacity_factor=1.0, router_num_groups=2),
    "prototype": dict(router_type="prototype", capacity_factor=1.5),
}
SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4)


@pytest.fixture
def no_eager_mask_shortcut():
    """Transformers' eager attention-mask builder reads the mask on the host to skip an all-ones mask (its own
    shortcut, skipped under torch.compile): switched off, so that only our code is under test."""
    names = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
    with mock.patch.multiple(masking_utils, **{name: lambda *a, **k: False for name in names}):
        yield


@pytest.fixture
def implementations(monkeypatch):
    """The implementation names the experts ran (every `table_choice`)."""
    seen = []
    real = experts_module.table_choice

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(experts_module, "table_choice", spy)
    return seen


def build(family, gate, dtype):
    with torch.device("meta"):
        if family == "gpt":
            model = GPTMoEForCausalLM(tiny_gpt_config(**SIZES, **GATES[gate]))
        elif family == "gpt2-style":
            config = tiny_gpt_config(**SIZES, **{**GPT2_STYLE, "num_key_value_heads": 4}, **GATES[gate])
            model = GPTMoEForCausalLM(config)
        else:
            model = Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config(**SIZES, **GATES[gate]))
    return model.to(dtype)


def meta_batch():
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("family", ["gpt", "gpt2-style", "seq2seq"])
def test_training_step_on_meta_reads_nothing_on_the_host(family, gate, no_eager_mask_shortcut, implementations):
    """bf16 training, as on an sm90 GPU: torch's grouped GEMM kernel, no host read in gates, experts or losses."""
    model = build(family, gate, torch.bfloat16).train()
    inputs = meta_batch()
    out = model(**inputs, labels=inputs["input_ids"], output_router_logits=True)
    out.loss.backward()
    assert out.loss.device.type == "meta"
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert set(implementations) == {"index_kernel"}


@pytest.mark.parametrize("family", ["gpt", "gpt2-style", "seq2seq"])
def test_whole_training_step_without_padding_reads_nothing_on_the_host(family, implementations):
    """The batch of a pretraining run (no attention mask), with Transformers' mask builders as they are: the model
    never hands them positions of its own, from which they would detect packed sequences by reading the device."""
    model = build(family, "topk", torch.bfloat16).train()
    ids = meta_batch()["input_ids"]
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert out.loss.device.type == "meta" and set(implementations) == {"index_kernel"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["gpt", "seq2seq"])
def test_decoding_step_on_meta_reads_nothing_on_the_host(family, dtype, no_eager_mask_shortcut, implementations):
    """Prefill, then one token with the cache, without gradients: fp32 takes `all_experts` (no kernel for it on any
    GPU), bf16 torch's kernel; neither reads the host, so a CUDA graph could capture the step."""
    model = build(family, "gshard", dtype).eval()
    inputs = meta_batch()
    with torch.no_grad():
        if family == "seq2seq":
            encoder = model.get_encoder()(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
            step = dict(encoder_outputs=encoder, attention_mask=inputs["attention_mask"])
            out = model(**step, decoder_input_ids=inputs["input_ids"][:, :5], use_cache=True)
            out = model(**step, decoder_input_ids=inputs["input_ids"][:, :1],
                        cache=out.past_key_values, use_cache=True)
        else:
            out = model(**inputs, use_cache=True)
            mask = torch.ones(2, 9, dtype=torch.long, device="meta")
            out = model(input_ids=inputs["input_ids"][:, :1], attention_mask=mask, cache=out.past_key_values,
                        use_cache=True)
    assert out.logits.shape[:2] == (2, 1)
    assert set(implementations) == ({"all_experts"} if dtype == torch.float32 else {"index_kernel"})


def test_compiled_decoding_of_many_tokens_reads_nothing_on_the_host(implementations):
    """Under torch.compile (where Transformers captures decoding in a CUDA graph) a no-gradient call takes
    `all_experts` for decoding batches up to 1024 tokens, where eager mode takes the host-read loop beyond 64."""
    layer = MoELayer(tiny_gpt_config(**SIZES, **GATES["topk-capacity"])).to("meta").eval()
    x = torch.empty(100, 64, device="meta")
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="reads its offsets on the host"):
            layer(x)
        assert implementations[-1] == "index_loop"
        out, _ = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    assert out.shape == (100, 64) and implementations[-1] == "all_experts"


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_einsum_dispatch_off_the_cpu_is_sized_by_the_gate_capacity():
    """Off the CPU the einsum implementation cannot read the batch's largest expert load; its buffers [G, S, E, C] must still
    be sized by the gate's capacity C, not by the group size S (O(E S^2))."""
    T, E, k, factor = 512, 8, 2, 1.0
    config = tiny_gpt_config(**SIZES, num_experts=E, num_experts_per_tok=k, capacity_factor=factor, experts_implementation="einsum")
    layer = MoELayer(config).to("meta").train()
    x = torch.empty(T, 64, device="meta")
    with LargestTensor() as largest:
        layer(x)
    capacity = int(factor * k * T / E)
    assert largest.numel <= T * k * E * capacity, (largest.numel, T * E * T)
