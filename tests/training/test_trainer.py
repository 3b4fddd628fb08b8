"""Transformers' Trainer on both families (hf_ppmoe.training.trainer): the logged LM, aux and z losses, router statistics
and evaluation perplexity equal a manual forward of the same batches; the router losses weigh the same whatever the
gradient accumulation and the number of data-parallel processes (1 x batch 4 == accumulation 2 x batch 2 == 2 gloo
processes x batch 2, parameter updates equal)."""

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.moe import Gate
from hf_ppmoe.training import MoESeq2SeqTrainer, MoETrainer
from helpers import stack_rows, tiny_gpt_config, tiny_seq2seq_config, trainer_args, trainer_rows

DP_WORKER = Path(__file__).with_name("trainer_dp.py")
FAMILIES = {
    "gpt": (GPTMoEForCausalLM, tiny_gpt_config, MoETrainer),
    "seq2seq": (Seq2SeqMoEForConditionalGeneration, tiny_seq2seq_config, MoESeq2SeqTrainer),
}


def manual(model, batches, family):
    """What the trainer should log for `batches` run through `model` as they are: token-weighted LM cross-entropy,
    aux and z losses, and per MoE layer the load CV and dropped fraction computed from the routes the model returns."""
    E, K = model.config.num_experts, model.config.num_experts_per_tok
    ce = tokens = aux = z = 0.0
    load, dropped = {}, {}
    with torch.no_grad():
        for b in batches:
            out = model(**b, output_router_logits=True)
            labels = b["labels"]
            logits = out.logits[:, :-1] if family == "gpt" else out.logits
            targets = labels[:, 1:] if family == "gpt" else labels
            n = (targets != -100).sum()
            ce += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
            tokens, aux, z = tokens + n, aux + n * out.aux_loss, z + n * out.z_loss
            if family == "gpt":
                stacks = {"layers": (out.router_expert_ids, torch.ones_like(labels, dtype=torch.bool))}
            else:  # decoder tokens with label -100 are padding for the router
                real = torch.ones_like(b["input_ids"], dtype=torch.bool)
                stacks = {"encoder.layers": (out.encoder_router_expert_ids, real), "decoder.layers": (out.decoder_router_expert_ids, labels != -100)}
            for stack, (routes, real) in stacks.items():
                for i, ids in enumerate(routes):  # every layer is MoE (moe_layer_frequency=1)
                    name = f"{stack}.{i}"
                    counts = torch.stack([(ids == e).sum() for e in range(E)]).float()
                    load[name] = load.get(name, 0) + counts
                    dropped.setdefault(name, []).append(1 - counts.sum() / (real.sum() * K))
    metrics = {"lm_loss": ce / tokens, "aux_loss": aux / tokens, "z_loss": z / tokens}
    for name, counts in load.items():
        metrics[f"expert_load_cv/{name}"] = counts.std(unbiased=False) / counts.mean()
        metrics[f"dropped_fraction/{name}"] = torch.stack(dropped[name]).mean()
    return {key: float(value) for key, value in metrics.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_logged_values_equal_a_manual_forward(family, tmp_path):
    """Two steps of accumulation 2 x batch 2 (rows with different label counts), logged together, with an evaluation
    in 2 batches with capacity (routes dropped) after each: every logged value equals the manual forward of those
    micro-batches (lr 0 keeps the weights, so both steps see the same forwards), the evaluation in the middle of the
    logging interval mixing nothing into the training values."""
    model_class, config, trainer_class = FAMILIES[family]
    model = model_class(config(router_z_loss_coef=0.01, eval_capacity_factor=1.0))
    reference = copy.deepcopy(model)
    data = trainer_rows(family)
    args = trainer_args(
        tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, per_device_eval_batch_size=2,
        max_steps=2, logging_steps=2, learning_rate=0.0, eval_strategy="steps", eval_steps=1,
        # Seq2SeqTrainer evaluates through generate too: its forwards (no labels) must not count
        **(dict(predict_with_generate=True, generation_max_length=4) if family == "seq2seq" else {}),
    )
    trainer = trainer_class(model=model, args=args, train_dataset=data, eval_dataset=data)
    trainer.train()
    (train_log,) = [e for e in trainer.state.log_history if "loss" in e]
    eval_logs = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert train_log["step"] == 2 and [e["step"] for e in eval_logs] == [1, 2]

    micro_batches = [stack_rows(data[:2]), stack_rows(data[2:])]
    expected_train = manual(reference.train(), micro_batches, family)
    expected_eval = manual(reference.eval(), micro_batches, family)
    expected_eval["perplexity"] = math.exp(expected_eval["lm_loss"])
    assert len(expected_train) == 3 + 2 * (2 if family == "gpt" else 4)  # per MoE layer: load CV, dropped fraction
    assert any(value > 0 for key, value in expected_eval.items() if key.startswith("dropped_fraction/"))
    for key, value in expected_train.items():
        assert train_log[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for eval_log in eval_logs:
        for key, value in expected_eval.items():
            assert eval_log[f"eval_{key}"] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert eval_log["eval_loss"] > eval_log["eval_lm_loss"]  # eval_loss counts the router terms
    c = model.config
    # Trainer's own loss: the token-normalised LM loss plus the router terms weighted by label tokens
    assert train_log["loss"] == pytest.approx(
        train_log["lm_loss"] + c.router_aux_loss_coef * train_log["aux_loss"] + c.router_z_loss_coef * train_log["z_loss"], rel=1e-5
    )


def one_row_per_router_group(model, rows_per_micro_batch):
    """A copy of `model` whose gates cut each micro-batch into one group per row: the aux loss is then a mean over
    rows, the same whatever rows share a micro-batch or a process (as the LM and z losses are)."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, Gate):
            module.num_groups = rows_per_micro_batch
    return model


def one_step(model, data, out, **overrides):
    """(model after one SGD step, lr 1 and no clipping, on `data` through MoETrainer; the training log entry)."""
    model = one_row_per_router_group(model, overrides["per_device_train_batch_size"])
    args = trainer_args(out, optim="sgd", learning_rate=1.0, max_grad_norm=0.0, **overrides)
    trainer = MoETrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return model, next(e for e in trainer.state.log_history if "loss" in e)


def assert_same_parameters(a, b, atol=2e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-5, msg=name)


def router_coupled_model():
    return GPTMoEForCausalLM(tiny_gpt_config(router_aux_loss_coef=0.5, router_z_loss_coef=0.1))


def test_router_losses_weigh_the_same_under_gradient_accumulation(tmp_path):
    """One process, batch 4 == accumulation 2 x batch 2: the same update. Only the weighting of the router losses
    could differ, and it did: Trainer added each micro-batch's router losses in full (twice the weight here)."""
    model = router_coupled_model()
    data = trainer_rows("gpt", labels_padded=False)
    whole, _ = one_step(model, data, tmp_path / "a", per_device_train_batch_size=4)
    accumulated, _ = one_step(model, data, tmp_path / "b", per_device_train_batch_size=2, gradient_accumulation_steps=2)
    assert_same_parameters(whole, accumulated)

    # the router losses alone move the weights by far more than the tolerance: a doubled weight would show
    probe = one_row_per_router_group(model, 4)
    out = probe(**stack_rows(data))
    (probe.config.router_aux_loss_coef * out.aux_loss + probe.config.router_z_loss_coef * out.z_loss).backward()
    assert max(p.grad.abs().max() for p in probe.parameters() if p.grad is not None) > 1e-3


def test_two_data_parallel_processes_equal_one(tmp_path):
    """2 gloo processes x batch 2 (and x accumulation 2 x batch 1) == one process x batch 4: the same update, and the
    same logged losses and router statistics (summed over the processes)."""
    model = router_coupled_model()
    model.save_pretrained(tmp_path / "init")
    data = trainer_rows("gpt", labels_padded=False)
    torch.save(data, tmp_path / "data.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(DP_WORKER), str(tmp_path)]
    job = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stderr[-6000:]

    reference, expected = one_step(model, data, tmp_path / "one", per_device_train_batch_size=4)
    logged = [k for k in expected if k.split("/")[0] in ("loss", "lm_loss", "aux_loss", "z_loss", "expert_load_cv", "dropped_fraction")]
    assert len(logged) == 8
    for run in ("dp2", "dp2_accumulate2"):
        result = torch.load(tmp_path / f"{run}.pt")
        trained = copy.deepcopy(reference)
        trained.load_state_dict(result["state_dict"])
        assert_same_parameters(reference, trained)
        for key in logged:
            assert result["log"][key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), (run, key)


def test_refuses_other_models(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    dense = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="GPTMoEForCausalLM or Seq2SeqMoEForConditionalGeneration.*GPT2LMHeadModel holds 0"):
        MoETrainer(model=dense, args=trainer_args(tmp_path))
