"""TRL's SFTTrainer, DPOTrainer and GRPOTrainer on a tiny GPT-MoE, in full precision and in 4-bit with LoRA
(`hf_ppmoe.peft.lora_config`, routers trained whole through `modules_to_save`): each trains two steps; the routers'
balance loss is part of the loss TRL optimises, shown by the routers' gradients: the first step's router gradient
differs from that of the same step (same weights, same batch) with `router_aux_loss_coef=0`. DPO runs as TRL documents
it: from a saved folder in full precision (TRL builds the reference from it), with adapters disabled as the
reference under LoRA. docs/quantization.md has the three recipes."""

import pytest
import torch

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM

trl = pytest.importorskip("trl", reason="the TRL recipes need trl (the test extra)")
pytest.importorskip("bitsandbytes", reason="the 4-bit recipes need bitsandbytes (the test extra)")
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TrainerCallback  # noqa: E402

from hf_ppmoe.peft import lora_config  # noqa: E402
from hf_ppmoe.training.data import train_tokenizer  # noqa: E402

TEXTS = [f"the {a} sat on the {b} mat" for a in ("cat", "dog", "owl", "fox") for b in ("red", "blue")]
COEF = 0.5


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """TRL's configs train in bfloat16 by default (mixed_precision="bf16" in Accelerate's process-wide state): reset it
    after each test, so that a later test's Accelerator(mixed_precision="no") in this process is not refused."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny GPT-MoE (sizes in whole 64-value blocks: bitsandbytes' CPU kernels) and its tokenizer, saved."""
    folder = tmp_path_factory.mktemp("trl") / "moe"
    tokenizer = train_tokenizer(TEXTS, vocab_size=300)
    torch.manual_seed(0)
    config = GPTMoEConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_experts=4, num_experts_per_tok=2, moe_layer_frequency=1,
                          router_aux_loss_coef=COEF, pad_token_id=tokenizer.pad_token_id,
                          eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    GPTMoEForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class RouterGradients(TrainerCallback):
    """The trainable parameters at the start, and the routers' gradients before each optimizer step."""

    def __init__(self):
        self.start, self.grads = None, []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.clone() for n, p in model.named_parameters() if ".gate." in n and p.grad is not None})


def run(kind: str, precision: str, folder, tmp_path, steps: int, coef: float | None = None):
    """Train `steps` steps of TRL's `kind` trainer; returns (trainer, RouterGradients)."""
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    args = dict(output_dir=str(tmp_path / f"{kind}-{precision}-{coef}"), max_steps=steps, per_device_train_batch_size=4,
                learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                seed=0, router_aux_loss_coef=coef, gradient_checkpointing=False)
    peft = {}
    if precision == "4bit":
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config)
        peft = {"peft_config": lora_config(model, r=4, lora_alpha=8, modules_to_save=["gate"])}
    else:
        model = GPTMoEForCausalLM.from_pretrained(folder)
    grads = RouterGradients()
    if kind == "sft":
        trainer = SFTTrainer(model=model, args=SFTConfig(**args, max_length=16), processing_class=tokenizer,
                             train_dataset=Dataset.from_dict({"text": TEXTS}), callbacks=[grads], **peft)
    elif kind == "dpo":
        pairs = Dataset.from_dict({"prompt": ["the cat sat on the"] * 8, "chosen": [" red mat"] * 8,
                                   "rejected": [" blue mat"] * 8})
        trainer = DPOTrainer(model=model if peft else str(folder), args=DPOConfig(**args, max_length=16),
                             processing_class=tokenizer, train_dataset=pairs, callbacks=[grads], **peft)
    else:
        def longer_is_better(completions, **kwargs):
            return [float(len(c)) for c in completions]

        trainer = GRPOTrainer(model=model, reward_funcs=longer_is_better, processing_class=tokenizer,
                              args=GRPOConfig(**args, num_generations=2, generation_batch_size=4, max_completion_length=4),
                              train_dataset=Dataset.from_dict({"prompt": ["the cat sat"] * 8}), callbacks=[grads], **peft)
    trainer.train()
    return trainer, grads


@pytest.mark.parametrize("precision", ["float32", "4bit"])
@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_trl_trainer_trains_with_the_balance_loss_in_its_loss(kind, precision, folder, tmp_path):
    trainer, grads = run(kind, precision, folder, tmp_path, steps=2)
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 2 and all("aux_loss" in e for e in logged)
    assert len(grads.grads) == 2 and len(grads.grads[0]) == 2  # both layers' routers have gradients
    if precision == "4bit":  # LoRA on every expert matrix, trained; the routers are modules_to_save copies
        assert all("modules_to_save" in n for n in grads.grads[0])
        expert_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n and ".experts." in n]
        assert len(expert_b) == 4 and all(p.abs().max() > 0 for p in expert_b)
    # the same first step without the balance loss: same weights, same batch, another router gradient
    _, without = run(kind, precision, folder, tmp_path, steps=1, coef=0.0)
    assert without.start.keys() == grads.start.keys()
    assert all(torch.equal(without.start[n], p) for n, p in grads.start.items())
    first, reference = grads.grads[0], without.grads[0]
    assert first.keys() == reference.keys()
    assert all(not torch.allclose(first[n], reference[n], rtol=1e-3, atol=1e-6) for n in first)
