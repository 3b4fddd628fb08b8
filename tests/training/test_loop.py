"""The training loop's named steps (hf_ppmoe.training.train): setup, forward_backward_step, train_step, evaluate;
Accelerate's FSDP request mapped onto our sharding; micro-batches without a target counted, not poisoning the run."""

import math
import os

import pytest
import torch

from hf_ppmoe import GPTMoEConfig
from hf_ppmoe.training import TrainArguments
from hf_ppmoe.training.data import builtin_corpus
from hf_ppmoe.training.parallel_setup import accelerate_fsdp_request
from hf_ppmoe.training.train import evaluate, forward_backward_step, setup, train_step


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    (root / "train.txt").write_text("\n\n".join(builtin_corpus()[:6]))
    GPTMoEConfig(
        vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, router_type="topk",
    ).to_json_file(root / "config.json")
    return root


def _args(files, out, **extra):
    values = dict(train_file=[str(files / "train.txt")], config_name=str(files / "config.json"), output_dir=str(out),
                  max_steps=3, per_device_train_batch_size=4, block_size=32, eval_batches=1, warmup_steps=0,
                  plots=False, seed=3)
    return TrainArguments(**{**values, **extra})


def test_train_step_is_the_models_loss_and_one_optimizer_step(files, tmp_path):
    """train_step's logged LM loss is the model's loss minus its router term on the step's batch, and it moves the
    weights once; evaluate's loss is the mean token cross-entropy on the validation batches."""
    run = setup(_args(files, tmp_path))
    model = run.accelerator.unwrap_model(run.model)
    batch = run.data.batch(0, 0)
    with torch.no_grad():
        out = model(**batch)
    expected_lm = out.loss - model.config.router_aux_loss_coef * out.aux_loss - model.config.router_z_loss_coef * out.z_loss
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sums, grad_norm = train_step(run, 0)
    torch.testing.assert_close(sums[0], expected_lm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sums[1], out.aux_loss, rtol=1e-5, atol=1e-6)
    assert grad_norm > 0
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if "router" not in n)
    metrics = evaluate(run)
    (val,) = run.data.validation_batches()
    with torch.no_grad():
        logits = model(val["input_ids"]).logits[:, :-1]
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), val["labels"][:, 1:].flatten())
    assert math.isclose(metrics["eval/loss"], ce.item(), rel_tol=1e-5)
    run.accelerator.end_training()


def test_a_batch_without_targets_is_counted_and_adds_nothing(files, tmp_path):
    """labels all -100: the micro-batch's LM loss is 0, its gradients zero, the run goes on, and the count shows it."""
    run = setup(_args(files, tmp_path))
    model = run.accelerator.unwrap_model(run.model)
    batch = run.data.batch(0, 0)
    empty = {"input_ids": batch["input_ids"], "labels": torch.full_like(batch["labels"], -100)}
    parts = forward_backward_step(run, empty)
    assert torch.isfinite(parts).all() and parts[0] == 0, parts
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert int(run.no_target) == 1
    forward_backward_step(run, batch)
    assert int(run.no_target) == 1
    run.accelerator.end_training()


@pytest.mark.parametrize(
    "env, world, tp, expected",
    [
        ({"ACCELERATE_USE_FSDP": "true"}, 4, 1, 4),  # FULL_SHARD by default: every data-parallel process shards
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "FULL_SHARD"}, 4, 2, 2),  # within tp groups
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "HYBRID_SHARD", "LOCAL_WORLD_SIZE": "2"}, 4, 1, 2),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "NO_SHARD"}, 4, 1, 1),
        ({}, 4, 1, 1),  # no request: nothing changes, nothing said
    ],
)
def test_accelerates_fsdp_request_is_mapped_onto_fsdp_size(monkeypatch, env, world, tp, expected):
    for name in ("ACCELERATE_USE_FSDP", "FSDP_SHARDING_STRATEGY", "LOCAL_WORLD_SIZE", "FSDP_RESHARD_AFTER_FORWARD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = TrainArguments(tp_size=tp)
    note = accelerate_fsdp_request(args, world)
    assert args.fsdp_size == expected
    assert (note is not None) == bool(env), note
    assert "ACCELERATE_USE_FSDP" not in os.environ  # Accelerate's own FSDP wrapper never sees the model


def test_every_other_accelerate_fsdp_option_is_named_in_the_runs_line(monkeypatch):
    """Issue 31: no Accelerate FSDP option is dropped without a word; those FSDP2 serves by construction are named."""
    for name in ("FSDP_SHARDING_STRATEGY", "FSDP_RESHARD_AFTER_FORWARD", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    given = {"ACCELERATE_USE_FSDP": "true", "FSDP_USE_ORIG_PARAMS": "true", "FSDP_SYNC_MODULE_STATES": "true",
             "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
             "FSDP_TRANSFORMER_CLS_TO_WRAP": "GPTMoEDecoderLayer", "FSDP_MIN_NUM_PARAMS": "0", "FSDP_VERSION": "2"}
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    note = accelerate_fsdp_request(TrainArguments(), 2)
    for name, value in given.items():
        if name != "ACCELERATE_USE_FSDP":
            assert f"{name.lower().removeprefix('fsdp_')}={value} (" in note, (name, note)


def test_an_fsdp_strategy_that_cannot_be_mapped_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "SHARD_EVERYTHING")
    with pytest.raises(ValueError, match="SHARD_EVERYTHING is not known.*--fsdp_size"):
        accelerate_fsdp_request(TrainArguments(), 2)


@pytest.mark.parametrize("env", [{"FSDP_RESHARD_AFTER_FORWARD": "false"}, {"FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"},
                                 {"FSDP_SHARDING_STRATEGY": "2"}, {"FSDP_RESHARD_AFTER_FORWARD": "SHARD_GRAD_OP"}])
def test_fsdp2_reshard_after_forward_false_is_honoured(monkeypatch, env):
    """Issue 31: `accelerate launch --fsdp_version 2 --fsdp_reshard_after_forward false` (FSDP2's SHARD_GRAD_OP)
    reached a run that said FULL_SHARD and resharded anyway."""
    for name, value in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", **env}.items():
        monkeypatch.setenv(name, value)
    args = TrainArguments()
    note = accelerate_fsdp_request(args, 4)
    assert args.fsdp_size == 4 and args.fsdp_reshard_after_forward is False
    assert "kept from its forward to its backward (reshard_after_forward=False)" in note


@pytest.mark.parametrize("name, value, words", [
    ("FSDP_OFFLOAD_PARAMS", "true", "CPU offload"),
    ("FSDP_ACTIVATION_CHECKPOINTING", "true", "activation checkpointing"),
    ("FSDP_FORWARD_PREFETCH", "true", "forward prefetching"),
    ("FSDP_BACKWARD_PREFETCH", "NO_PREFETCH", "BACKWARD_PRE"),
    ("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP", "TRANSFORMER_BASED_WRAP"),
    ("FSDP_IGNORED_MODULES", "lm_head", "every module is sharded"),
    ("FSDP_RESHARD_AFTER_FORWARD", "sometimes", "use true or false"),
])
def test_every_accelerate_fsdp_option_we_cannot_honour_is_refused_in_one_line(monkeypatch, name, value, words):
    # what `accelerate launch --use_fsdp --fsdp_version 2` sets by default passes (the test above)
    defaults = {"FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "false", "FSDP_RESHARD_AFTER_FORWARD": "true",
                "FSDP_FORWARD_PREFETCH": "false", "FSDP_ACTIVATION_CHECKPOINTING": "false",
                "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false", "FSDP_USE_ORIG_PARAMS": "true"}
    for key, default in {"ACCELERATE_USE_FSDP": "true", **defaults, name: value}.items():
        monkeypatch.setenv(key, default)
    with pytest.raises(ValueError, match=f"^accelerate launch --{name.lower()} {value}: .*{words}") as refused:
        accelerate_fsdp_request(TrainArguments(), 2)
    assert "\n" not in str(refused.value)
