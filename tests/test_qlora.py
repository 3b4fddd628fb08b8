"""QLoRA on the experts: a 4-bit GPT-MoE (`from_pretrained(..., quantization_config=BitsAndBytesConfig(...))`) prepared
with PEFT's `prepare_model_for_kbit_training` and adapted with `hf_ppmoe.peft.lora_config`. Every expert's LoRA
adapters train while the 4-bit storage stays as loaded; routers stay frozen unless `modules_to_save=["gate"]`; the
adapter saved and loaded on a fresh 4-bit model (`load_adapter`) gives the same logits, PEFT's own loader is refused
by name; the adapted experts compute exactly what PEFT computes on their dequantized values; merging is
dequantize -> load the adapter -> `merge_and_unload` -> save."""

import copy

import pytest
import torch

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
from hf_ppmoe.moe import Experts

pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (the test extra)")
from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

from hf_ppmoe.peft import load_adapter, lora_config  # noqa: E402

CONFIG = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qlora") / "moe"
    torch.manual_seed(0)
    config = GPTMoEConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_experts=4, num_experts_per_tok=2, moe_layer_frequency=1, router_aux_loss_coef=0.1)
    GPTMoEForCausalLM(config).save_pretrained(folder)
    return folder


def batch(seed=0):
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch(1)["input_ids"]).logits


def plain_name(name: str) -> str:
    """A parameter's name in the model PEFT wraps, without PEFT's prefixes and wrapper levels."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def storage_bytes(model):
    return {plain_name(n): p.detach().clone() for n, p in model.named_parameters() if ".parametrizations." in n}


def train(model, steps=3):
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gate_grads = []
    for step in range(steps):
        loss = model(**batch(step)).loss
        loss.backward()
        gate_grads.append([p.grad for n, p in model.named_parameters() if "gate" in n.split(".") and p.requires_grad])
        optimizer.step()
        optimizer.zero_grad()
    return gate_grads


def test_qlora_trains_every_expert_adapter_and_round_trips(folder, tmp_path):
    model = prepare_model_for_kbit_training(AutoModelForCausalLM.from_pretrained(folder, quantization_config=CONFIG))
    before = storage_bytes(model)
    routers = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("gate.weight")}
    peft_model = get_peft_model(model, lora_config(model, r=4, lora_alpha=8))
    train(peft_model)

    expert_b = {n: p for n, p in peft_model.named_parameters() if "lora_B" in n and ".experts." in n}
    assert len(expert_b) == 4 and all(p.abs().max() > 0 for p in expert_b.values())  # both matrices, both layers
    after = storage_bytes(peft_model)
    assert len(after) == len(before) == 4 and all(torch.equal(after[plain_name(n)], t) for n, t in before.items())
    frozen = {plain_name(n): p for n, p in peft_model.named_parameters() if n.endswith("gate.weight")}
    assert frozen.keys() == routers.keys() and all(not p.requires_grad and torch.equal(p, routers[n]) for n, p in frozen.items())

    adapted = logits(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    fresh = AutoModelForCausalLM.from_pretrained(folder, quantization_config=CONFIG)
    assert torch.equal(logits(load_adapter(fresh, tmp_path / "adapter")), adapted)
    # PEFT's own loader puts its own wrapper on the quantized experts: refused by name at the first forward pass
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, quantization_config=CONFIG), tmp_path / "adapter")
    with pytest.raises(ValueError, match="hf_ppmoe.peft.load_adapter"):
        logits(plain)
    # merging into the 4-bit experts would round the adapter away: refused
    with pytest.raises(ValueError, match="Dequantize the base model first"):
        peft_model.merge_and_unload()

    # the documented merge: dequantize, load the adapter, merge, save
    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=CONFIG).dequantize()
    on_dequantized = PeftModel.from_pretrained(base, tmp_path / "adapter")
    expected = logits(on_dequantized)
    merged = on_dequantized.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(reloaded) is GPTMoEForCausalLM and not getattr(reloaded, "is_quantized", False)
    torch.testing.assert_close(logits(reloaded), expected, rtol=0, atol=1e-5)
    # the dequantized model computes what the 4-bit one did, up to Transformers' Linear4bit kernel (attention) on CPU,
    # which computes in bfloat16 where the CPU has it
    assert (expected - adapted).abs().mean() < 2e-3 and (expected - adapted).abs().max() < 0.1


def test_adapted_quantized_experts_equal_peft_on_their_dequantized_values(folder):
    """At the experts: LoRA on the 4-bit storage (hf_ppmoe.peft's wrapper) == PEFT's own LoRA on plain parameters holding
    the dequantized values, same adapter weights: outputs and adapter gradients, bit for bit."""
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=CONFIG)
    quantized = get_peft_model(model, lora_config(model, r=4, lora_alpha=8, init_lora_weights=False))
    plain = copy.deepcopy(quantized.base_model.model).dequantize()
    reference = get_peft_model(plain, lora_config(plain, r=4, lora_alpha=8))
    reference.load_state_dict({k: v for k, v in quantized.state_dict().items() if "lora_" in k}, strict=False)
    a, b = (next(m for m in peft.modules() if isinstance(m, Experts)) for peft in (quantized, reference))
    wrapper_a, wrapper_b = (peft.base_model.model.model.layers[0].mlp.experts for peft in (quantized, reference))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 4, (8, 2), generator=torch.Generator().manual_seed(1))
    weights = torch.rand(8, 2, generator=torch.Generator().manual_seed(2))
    out_a, out_b = wrapper_a(x, ids, weights), wrapper_b(x, ids, weights)
    assert type(a) is not type(b) and torch.equal(out_a, out_b)
    out_a.square().sum().backward()
    out_b.square().sum().backward()
    grads = [[p.grad for n, p in w.named_parameters() if "lora_" in n] for w in (wrapper_a, wrapper_b)]
    assert len(grads[0]) == 4 and all(torch.equal(g, h) for g, h in zip(*grads))


def test_routers_train_in_full_precision_with_modules_to_save(folder):
    model = prepare_model_for_kbit_training(AutoModelForCausalLM.from_pretrained(folder, quantization_config=CONFIG))
    peft_model = get_peft_model(model, lora_config(model, r=4, lora_alpha=8, modules_to_save=["gate"]))
    gate_grads = train(peft_model, steps=1)[0]
    assert len(gate_grads) == 2 and all(g is not None and g.dtype == torch.float32 and g.abs().max() > 0 for g in gate_grads)
