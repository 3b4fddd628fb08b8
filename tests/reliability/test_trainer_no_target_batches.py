"""Issue 25, MoETrainer: a micro-batch whose labels have no target token (all -100, or one-token sequences of a causal
LM) is counted in the log (`no_target_batches`) and weighs nothing (the model's loss for it is 0, without gradient):
the step equals the step on the other micro-batches alone, and nothing turns NaN."""

import copy
import math

import pytest
import torch
from helpers import tiny_gpt_config, tiny_seq2seq_config, trainer_args, trainer_rows

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.training import MoETrainer


def _no_target_rows(family, rows):
    """Two rows like `rows[:2]` without a target: all -100, and (GPT-MoE) one label token, which nothing predicts."""
    blank = [dict(r, labels=torch.full_like(r["labels"], -100)) for r in rows[:2]]
    if family == "gpt":
        blank[1]["labels"][0] = blank[1]["input_ids"][0]
    return blank


def _train(model, data, out, accumulation):
    args = trainer_args(out, optim="sgd", learning_rate=1.0, max_grad_norm=0.0, per_device_train_batch_size=2,
                        gradient_accumulation_steps=accumulation)
    trainer = MoETrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return next(e for e in trainer.state.log_history if "loss" in e)


@pytest.mark.parametrize("family", ["gpt", "seq2seq"])
def test_a_micro_batch_without_targets_is_counted_and_zero_weighted(family, tmp_path):
    torch.manual_seed(0)
    config = tiny_gpt_config() if family == "gpt" else tiny_seq2seq_config()
    model_class = GPTMoEForCausalLM if family == "gpt" else Seq2SeqMoEForConditionalGeneration
    model = model_class(config)
    rows = trainer_rows(family, labels_padded=False, n=2)
    alone, mixed = copy.deepcopy(model), copy.deepcopy(model)

    log_alone = _train(alone, rows, tmp_path / "alone", accumulation=1)
    log_mixed = _train(mixed, _no_target_rows(family, rows) + rows, tmp_path / "mixed", accumulation=2)

    assert log_mixed["no_target_batches"] == 1 and log_alone["no_target_batches"] == 0
    assert math.isfinite(log_mixed["loss"]) and math.isfinite(log_mixed["lm_loss"])
    assert log_mixed["lm_loss"] == pytest.approx(log_alone["lm_loss"], rel=1e-5)
    for (name, p), q in zip(mixed.named_parameters(), alone.parameters()):
        assert torch.isfinite(p).all(), name
        torch.testing.assert_close(p, q, atol=2e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("family", ["gpt", "seq2seq"])
def test_a_step_without_any_target_changes_nothing(family, tmp_path):
    torch.manual_seed(0)
    model = GPTMoEForCausalLM(tiny_gpt_config()) if family == "gpt" else Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config())
    before = copy.deepcopy(model)
    log = _train(model, _no_target_rows(family, trainer_rows(family, labels_padded=False, n=2)), tmp_path, accumulation=1)
    assert log["no_target_batches"] == 1 and log["loss"] == 0.0
    for (name, p), q in zip(model.named_parameters(), before.parameters()):
        assert torch.equal(p, q), name  # a zero gradient: plain SGD leaves every weight as it was
