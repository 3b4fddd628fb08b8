"""LoRA through PEFT on both families (hf_ppmoe.peft.lora_config): attention, dense FFNs and every expert adapted;
trained with MoETrainer (its metrics through the PEFT wrapper), the adapter saved and reloaded on a fresh base model
(logits equal), `merge_and_unload` equal to the adapted model (logits)."""

import copy
import warnings

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.peft import lora_config
from hf_ppmoe.training import MoESeq2SeqTrainer, MoETrainer
from helpers import stack_rows, tiny_gpt_config, tiny_seq2seq_config, trainer_args, trainer_rows

FAMILIES = {
    "gpt": (GPTMoEForCausalLM, tiny_gpt_config, MoETrainer),
    "seq2seq": (Seq2SeqMoEForConditionalGeneration, tiny_seq2seq_config, MoESeq2SeqTrainer),
}


def logits(model, inputs):
    model.eval()
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_trains_saves_reloads_and_merges(family, tmp_path):
    model_class, config, trainer_class = FAMILIES[family]
    base = model_class(config(moe_layer_frequency=2))  # MoE and dense FFN layers
    pristine = copy.deepcopy(base)
    data = trainer_rows(family)
    inputs = stack_rows(data)
    before = logits(base, inputs)

    with warnings.catch_warnings():  # issue 46: PEFT reads Transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("error", FutureWarning)
        model = get_peft_model(base, lora_config(base, r=4, lora_alpha=8))
    tuner = model.base_model
    expert_params = sorted(n for n, p in pristine.named_parameters() if p.dim() == 3)
    assert sorted(tuner.targeted_parameter_names) == expert_params and len(expert_params) == (2 if family == "gpt" else 4)
    assert any(name.endswith("self_attn.q_proj") for name in tuner.targeted_module_names)
    assert any(name.endswith("mlp.down_proj") for name in tuner.targeted_module_names)  # the dense FFN layers
    assert not any("lm_head" in name or "gate" == name.rpartition(".")[2] for name in tuner.targeted_module_names)

    args = trainer_args(tmp_path / "run", per_device_train_batch_size=4, max_steps=3, learning_rate=3e-2)
    trainer = trainer_class(model=model, args=args, train_dataset=data)
    trainer.train()
    log = [e for e in trainer.state.log_history if "loss" in e]
    assert len(log) == 3 and all("lm_loss" in e and any(k.startswith("expert_load_cv/") for k in e) for e in log)
    assert log[-1]["lm_loss"] < log[0]["lm_loss"]
    # the experts' adapters were trained (B starts at zero); the base weights were not
    expert_b = [p for n, p in model.named_parameters() if "lora_B" in n and "experts" in n]
    assert len(expert_b) == len(expert_params) and all(p.abs().max() > 0 for p in expert_b)
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    adapted = logits(model, inputs)
    assert not torch.allclose(adapted, before, atol=1e-4)

    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(copy.deepcopy(pristine), tmp_path / "adapter")
    torch.testing.assert_close(logits(reloaded, inputs), adapted, rtol=0, atol=1e-6)

    merged = model.merge_and_unload()
    assert type(merged) is model_class and not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, inputs), adapted, rtol=1e-5, atol=1e-5)


def test_lora_config_refuses_a_model_without_experts():
    dense = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no MoE experts; use peft.LoraConfig"):
        lora_config(dense)
