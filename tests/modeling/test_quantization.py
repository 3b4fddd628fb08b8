"""Quantized experts through Transformers' own call, `from_pretrained(..., quantization_config=BitsAndBytesConfig(...))`
(hf_ppmoe.modeling.quantization), on bitsandbytes' CPU backend: every expert weight stored as bitsandbytes quantizes
the checkpoint's tensor (NF4 with double quantization, FP4, int8), routers untouched in full precision, the logit
error within 1.5x that of the same-shape dense Llama quantized by Transformers, save/load round trips (GPT-MoE and
Seq2Seq-MoE), an upcycled dense checkpoint loaded straight into 4-bit with the dense layers' own 4-bit values, and
torchao's int8 weight-only config on the experts too, and the configs that would leave experts in full precision
refused by name."""

import pytest
import torch
from helpers import tiny_seq2seq_config

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.moe import Experts, Gate
from hf_ppmoe.moe.quantized import quantized_weight

bnb = pytest.importorskip("bitsandbytes", reason="quantized experts need bitsandbytes (the test extra)")
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

F = bnb.functional
# sizes in whole 64-value blocks a row: bitsandbytes 0.50's CPU 4-bit kernels misread other rows, in Transformers' own
# Linear4bit layers too (tests/moe/test_quantized.py)
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, tie_word_embeddings=False)
CONFIGS = {
    "nf4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "int8": dict(load_in_8bit=True),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A GPT-MoE (Llama style: rotary, RMSNorm, SwiGLU experts; 4 experts, top-2) and the dense Llama of its shape,
    from the same seed, saved in float32."""
    root = tmp_path_factory.mktemp("quantization")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(root / "dense")
    torch.manual_seed(0)
    GPTMoEForCausalLM(GPTMoEConfig(**SHAPE, num_experts=4, num_experts_per_tok=2, moe_layer_frequency=1)).save_pretrained(root / "moe")
    return root


def ids(batch=2, length=24, seed=1):
    return torch.randint(0, SHAPE["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids).logits


def bnb_quantization(W: torch.Tensor, config: dict):
    """(stored tensor, scales) bitsandbytes makes of the [E * O, I] matrix of a stacked weight under `config`."""
    matrix = W.reshape(-1, W.shape[-1])
    if config.get("load_in_8bit"):
        CB, SCB, _ = F.int8_vectorwise_quant(matrix.half())
        return CB, SCB
    packed, state = F.quantize_4bit(matrix, quant_type=config["bnb_4bit_quant_type"],
                                    compress_statistics=config.get("bnb_4bit_use_double_quant", False))
    return packed, state.absmax


@pytest.mark.parametrize("name", CONFIGS)
def test_experts_stored_quantized_routers_untouched_and_round_trip(folders, name, tmp_path):
    config = CONFIGS[name]
    full = GPTMoEForCausalLM.from_pretrained(folders / "moe")
    model = AutoModelForCausalLM.from_pretrained(folders / "moe", quantization_config=BitsAndBytesConfig(**config))
    assert getattr(model, "is_loaded_in_8bit" if config.get("load_in_8bit") else "is_loaded_in_4bit")
    kinds = (Experts, Gate)
    pairs = list(zip([m for m in full.modules() if isinstance(m, kinds)], [m for m in model.modules() if isinstance(m, kinds)]))
    assert len(pairs) == 4
    for reference, module in pairs:
        if isinstance(module, Gate):  # the router: a plain float32 parameter, the checkpoint's values
            assert type(module.weight) is torch.nn.Parameter and torch.equal(module.weight, reference.weight)
            continue
        for weight in ("gate_up_proj", "down_proj"):
            storage = quantized_weight(module, weight)
            stored, scales = bnb_quantization(getattr(reference, weight).detach(), config)
            assert torch.equal(storage.weight.data, stored)
            assert torch.equal(storage.weight.SCB if storage.bits == 8 else storage.weight.quant_state.absmax, scales)
    # no expert weight in full precision anywhere: every float tensor of the state dict is a matrix or less
    state = model.state_dict()
    assert all(t.dim() < 3 for t in state.values() if t.is_floating_point())
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in state)

    # saved before any forward pass: bitsandbytes' Linear4bit repacks its weight for its CPU kernel on the first one
    # (and a double-quantized one is not packed back bit for bit: Transformers' layers, not the experts)
    model.save_pretrained(tmp_path / "quantized")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "quantized")
    again_state = again.state_dict()
    assert again_state.keys() == state.keys() and all(torch.equal(again_state[k], t) for k, t in state.items())
    assert torch.equal(logits(again, ids()), logits(model, ids()))
    assert torch.equal(model.generate(ids(1, 6), max_new_tokens=6, do_sample=False),
                       again.generate(ids(1, 6), max_new_tokens=6, do_sample=False))


def test_4bit_footprint_of_an_experts_dominated_model_is_under_0_30x_bfloat16(tmp_path):
    """The issue's target, in bytes (device-independent): experts at least 97% of the weights, the 4-bit load's
    `get_memory_footprint()` at most 0.30x the bfloat16 load's."""
    torch.manual_seed(0)
    config = GPTMoEConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                          num_experts=32, num_experts_per_tok=2, moe_layer_frequency=1, tie_word_embeddings=False)
    model = GPTMoEForCausalLM(config)
    share = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) / model.num_parameters()
    model.save_pretrained(tmp_path)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True))
    assert share >= 0.97 and quantized.num_parameters() == bf16.num_parameters()
    assert quantized.get_memory_footprint() <= 0.30 * bf16.get_memory_footprint()


@pytest.mark.parametrize("name", CONFIGS)
def test_logit_error_within_1_5x_of_the_dense_llama(folders, name):
    """Mean |quantized - float32| logit, over the float32 logits' spread: the GPT-MoE's against the same-shape dense
    Llama's quantized by Transformers' own bitsandbytes path (same seed; more seeds and a larger shape:
    benchmarks/quantization.py)."""

    def error(folder):
        reference = logits(AutoModelForCausalLM.from_pretrained(folder), ids())
        quantized = logits(AutoModelForCausalLM.from_pretrained(folder, quantization_config=BitsAndBytesConfig(**CONFIGS[name])), ids())
        return ((quantized - reference).abs().mean() / reference.std()).item()

    moe, dense = error(folders / "moe"), error(folders / "dense")
    assert 0 < moe <= 1.5 * dense, (moe, dense)


def test_upcycled_dense_checkpoint_loads_straight_into_4bit(folders, tmp_path):
    """`upcycle` of the dense Llama, saved, loaded with a 4-bit config: every expert holds exactly the 4-bit values
    Transformers gives the dense model's own MLP under the same config."""
    from hf_ppmoe.conversion import upcycle

    upcycle(folders / "dense", num_experts=4, num_experts_per_tok=2).save_pretrained(tmp_path / "upcycled")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    moe = AutoModelForCausalLM.from_pretrained(tmp_path / "upcycled", quantization_config=config)
    dense = AutoModelForCausalLM.from_pretrained(folders / "dense", quantization_config=config)

    def values(linear):
        return F.dequantize_4bit(linear.weight.data, linear.weight.quant_state)

    layers = [(i, layer.mlp.experts) for i, layer in enumerate(moe.model.layers) if hasattr(layer.mlp, "experts")]
    assert layers
    for i, experts in layers:
        mlp = dense.model.layers[i].mlp
        gate_up, down = torch.cat([values(mlp.gate_proj), values(mlp.up_proj)]), values(mlp.down_proj)
        for e in range(4):
            assert torch.equal(experts.gate_up_proj[e], gate_up) and torch.equal(experts.down_proj[e], down)


def test_seq2seq_moe_round_trip_in_4bit(tmp_path):
    torch.manual_seed(0)
    full = Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config(hidden_size=64, intermediate_size=128, vocab_size=128))
    full.save_pretrained(tmp_path / "full")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "full", quantization_config=config)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert len(experts) == 4 and all(quantized_weight(m, "down_proj") is not None for m in experts)
    x = ids(2, 10)
    with torch.no_grad():
        out = model(input_ids=x, decoder_input_ids=x).logits
        assert (out - full(input_ids=x, decoder_input_ids=x).logits).abs().max() < 0.5
    model.save_pretrained(tmp_path / "quantized")
    again = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "quantized")
    with torch.no_grad():
        assert torch.equal(again(input_ids=x, decoder_input_ids=x).logits, out)
    assert torch.equal(again.generate(x[:1], max_new_tokens=4), model.generate(x[:1], max_new_tokens=4))


@pytest.mark.parametrize("config, match", [
    (dict(load_in_4bit=True, llm_int8_skip_modules=["experts"]), r"llm_int8_skip_modules=\['experts'\] names the experts"),
    (dict(load_in_4bit=True, llm_int8_skip_modules=["model.layers.1.mlp"]), "model.layers.1.mlp.experts"),
    (dict(load_in_8bit=True, llm_int8_has_fp16_weight=True), "llm_int8_has_fp16_weight"),
])
def test_configs_that_would_skip_the_experts_are_refused(folders, config, match):
    with pytest.raises(ValueError, match=match):
        AutoModelForCausalLM.from_pretrained(folders / "moe", quantization_config=BitsAndBytesConfig(**config))


def test_torchao_int8_weight_only_experts(folders, tmp_path):
    """`TorchAoConfig(Int8WeightOnlyConfig())`: every expert weight is torchao's own int8 quantization of the
    checkpoint's tensor (values and row scales), computed from its dequantization; Transformers' torchao serialization
    round-trips it."""
    pytest.importorskip("torchao", reason="the torchao path needs torchao (the test extra)")
    from torch import nn
    from torchao.quantization import FqnToConfig, Int8WeightOnlyConfig, quantize_
    from transformers import TorchAoConfig

    full = GPTMoEForCausalLM.from_pretrained(folders / "moe")
    model = AutoModelForCausalLM.from_pretrained(folders / "moe", quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    pairs = list(zip([m for m in full.modules() if isinstance(m, Experts)], [m for m in model.modules() if isinstance(m, Experts)]))
    assert len(pairs) == 2
    for reference, module in pairs:
        for weight in ("gate_up_proj", "down_proj"):
            storage, own = quantized_weight(module, weight), nn.Module()
            own.weight = nn.Parameter(getattr(reference, weight).detach().clone(), requires_grad=False)
            quantize_(own, FqnToConfig({"weight": Int8WeightOnlyConfig()}), filter_fn=None)
            assert storage.weight.qdata.dtype == torch.int8
            assert torch.equal(storage.weight.qdata, own.weight.qdata) and torch.equal(storage.weight.scale, own.weight.scale)
            assert torch.equal(getattr(module, weight), own.weight.dequantize())
    model.save_pretrained(tmp_path / "torchao")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "torchao")
    out = logits(model, ids())
    assert torch.equal(logits(again, ids()), out)
    assert ((out - logits(full, ids())).abs().mean() / out.std()) < 0.05


def test_another_quantization_method_is_refused_by_name(folders):
    from transformers import QuantoConfig

    from hf_ppmoe.modeling.quantization import check_quantization

    model = GPTMoEForCausalLM.from_pretrained(folders / "moe")
    with pytest.raises(ValueError, match=r"quant_method='quanto'.*full precision.*BitsAndBytesConfig\(load_in_4bit=True\)"):
        check_quantization(model, QuantoConfig())
    # a router named in llm_int8_skip_modules is fine: routers are never quantized
    check_quantization(model, BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["gate"]))
    pytest.importorskip("torchao", reason="the torchao path needs torchao (the test extra)")
    from torchao.quantization import FqnToConfig, Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    with pytest.raises(ValueError, match="FqnToConfig names layers one by one"):
        check_quantization(model, TorchAoConfig(FqnToConfig({"_default": Int8WeightOnlyConfig()})))
    with pytest.raises(ValueError, match="modules_to_not_convert=.*names the experts"):
        check_quantization(model, TorchAoConfig(Int8WeightOnlyConfig(), modules_to_not_convert=["experts"]))
