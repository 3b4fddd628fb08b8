"""Per-step balancing in training: 2 data-parallel processes update the expert biases and global-batch fractions
exactly as one process over the same global batch, and the global-batch loss and router gradient are the same;
the training loop (`python -m hf_ppmoe.training`) and `MoETrainer` update the bias after every optimizer step, and
the loop's checkpoints carry the fractions."""

import copy
import json

import pytest
import torch
from helpers import tiny_gpt_config

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
from hf_ppmoe.moe import LoadBalancer, MoELayer, bias_update

SETTINGS = {
    "bias": dict(router_expert_bias=True, router_bias_update_rate=0.05),
    "sigmoid-bias-global": dict(router_expert_bias=True, router_score_function="sigmoid",
                                router_aux_loss_scope="global_batch"),
}


def model_and_batches(settings, steps=3, rows=8):
    torch.manual_seed(0)
    model = GPTMoEForCausalLM(tiny_gpt_config(num_hidden_layers=2, **settings)).train()
    return model, torch.randint(3, 97, (steps, rows, 9), generator=torch.Generator().manual_seed(1))


def train_steps(model, batches, micro, reduce=None, world=1, lr=0.1):
    """SGD steps over `batches` (this process's rows of each step), `micro` micro-batches each; gradients summed
    over the processes by `reduce` and divided by `world` (data parallelism); balancing after each step."""
    balancer = LoadBalancer(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in batches:
        for part in batch.chunk(micro):
            (model(part, labels=part).loss / micro).backward()
        if reduce is not None:
            for p in model.parameters():
                p.grad = reduce(p.grad) / world
        optimizer.step()
        optimizer.zero_grad()
        balancer.step(reduce)
    balancer.remove()


def gates(model):
    return [m.gate for m in model.modules() if isinstance(m, MoELayer)]


@pytest.mark.distributed(2)
def test_two_data_parallel_processes_balance_exactly_as_one_process():
    import torch.distributed as dist

    from hf_ppmoe.parallel import count_collectives, sum_over

    rank = dist.get_rank()
    for name, settings in SETTINGS.items():
        model, batches = model_and_batches(settings)
        reference = copy.deepcopy(model)
        train_steps(reference, batches, micro=4)  # one process: the global batch of 8 rows, 4 micro-batches
        mine = batches.chunk(2, dim=1)[rank]  # this process's 4 rows of every step, 2 micro-batches
        train_steps(model, mine, micro=2, reduce=sum_over(), world=2)
        for ours, theirs in zip(gates(model), gates(reference)):
            assert torch.equal(ours.expert_bias, theirs.expert_bias), name
            assert ours.expert_bias.abs().sum() > 0, name
            if ours.global_fraction is not None:
                assert torch.equal(ours.global_fraction, theirs.global_fraction), name
        # one collective per step for all layers
        balancer = LoadBalancer(model)
        model(mine[0], labels=mine[0])
        with count_collectives() as seen:
            balancer.step(sum_over())
        assert [c.op for c in seen.calls] == ["all_reduce"], seen.calls


@pytest.mark.distributed(2)
def test_global_batch_loss_and_router_gradient_equal_on_one_or_two_processes():
    import torch.distributed as dist

    from hf_ppmoe.parallel import sum_over

    rank = dist.get_rank()
    model, batches = model_and_batches(dict(router_aux_loss_scope="global_batch"), steps=1)
    reference = copy.deepcopy(model)
    train_steps(reference, batches, micro=1, lr=0.0)
    train_steps(model, batches.chunk(2, dim=1)[rank], micro=1, reduce=sum_over(), world=2, lr=0.0)
    batch = torch.randint(3, 97, (8, 9), generator=torch.Generator().manual_seed(7))
    whole = reference(batch, labels=batch)
    whole.aux_loss.backward()
    part = batch.chunk(2)[rank]
    mine = model(part, labels=part)
    mine.aux_loss.backward()
    reduce = sum_over()
    torch.testing.assert_close(reduce(mine.aux_loss.detach()) / 2, whole.aux_loss.detach())
    for ours, theirs in zip(gates(model), gates(reference)):
        torch.testing.assert_close(reduce(ours.weight.grad) / 2, theirs.weight.grad, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------ the loop and Trainer


def test_training_loop_moves_the_bias_and_checkpoints_the_fractions(tmp_path):
    from hf_ppmoe.training import TrainArguments
    from hf_ppmoe.training.data import builtin_corpus
    from hf_ppmoe.training.train import setup, train_step

    (tmp_path / "train.txt").write_text("\n\n".join(builtin_corpus()[:6]))
    GPTMoEConfig(
        vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, router_expert_bias=True,
        router_aux_loss_scope="global_batch", router_bias_update_rate=0.01,
    ).to_json_file(tmp_path / "config.json")
    args = TrainArguments(train_file=[str(tmp_path / "train.txt")], config_name=str(tmp_path / "config.json"),
                          output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, block_size=32,
                          eval_batches=1, warmup_steps=0, plots=False, seed=3, gradient_accumulation_steps=2)
    run = setup(args)
    model = run.accelerator.unwrap_model(run.model)
    watch = LoadBalancer(model)  # a second balancer beside the loop's: it counts the step's routes too
    train_step(run, 0)
    counts, E = watch.pending(), model.config.num_experts
    assert counts[:, -1].tolist() == [2 * 4 * 32] * len(counts)  # both micro-batches' tokens
    for gate, row in zip(gates(model), counts):  # the loop updated from the whole step's counts
        torch.testing.assert_close(gate.expert_bias, bias_update(row[:E], 0.01), rtol=0, atol=0)
        torch.testing.assert_close(gate.global_fraction, row[E : 2 * E] / row[-1], rtol=0, atol=0)
        assert gate.expert_bias.abs().sum() > 0 and abs(gate.expert_bias.sum().item()) < 1e-6
    watch.remove()
    run.accelerator.save_state(str(tmp_path / "state"))
    fractions = [g.global_fraction.clone() for g in gates(model)]
    for gate in gates(model):
        gate.global_fraction.zero_()
    run.accelerator.load_state(str(tmp_path / "state"))
    for gate, fraction in zip(gates(model), fractions):
        assert torch.equal(gate.global_fraction, fraction)
    run.accelerator.end_training()


def test_moe_trainer_updates_the_bias_after_every_optimizer_step(tmp_path):
    from datasets import Dataset
    from transformers import TrainingArguments

    from hf_ppmoe.training import MoETrainer

    torch.manual_seed(0)
    model = GPTMoEForCausalLM(tiny_gpt_config(router_expert_bias=True, router_bias_update_rate=0.01))
    ids = torch.randint(3, 97, (8, 9), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=0.0,
                             report_to=[], use_cpu=True, logging_steps=1, save_strategy="no")
    trainer = MoETrainer(model=model, args=args, train_dataset=data)
    reference = copy.deepcopy(model)
    trainer.train()
    # lr 0: the routes of the two steps are the reference's, each step's batch of 4 rows, in the trainer's order
    ref_balancer = LoadBalancer(reference)
    loader = trainer.get_train_dataloader()
    for batch in list(loader)[:2]:
        reference(batch["input_ids"], labels=batch["labels"])
        ref_balancer.step()
    assert any(gate.expert_bias.abs().sum() > 0 for gate in gates(model))
    for ours, theirs in zip(gates(model), gates(reference)):
        torch.testing.assert_close(ours.expert_bias, theirs.expert_bias, rtol=0, atol=1e-7)
    assert json.dumps(trainer.state.log_history)  # logs as usual


def test_load_metrics_max_over_mean_and_dead_experts():
    """RouterMonitor's per-layer loads: counts sum to real tokens x k (dropless; padding excluded), the largest load
    over the mean and the experts no route reached, as logged by the loop and the Trainer."""
    from hf_ppmoe.training.tracking import RouterMonitor

    torch.manual_seed(0)
    model = GPTMoEForCausalLM(tiny_gpt_config(router_expert_bias=True)).train()
    first = gates(model)[0]
    with torch.no_grad():
        first.expert_bias[3] = -100.0  # expert 3 of the first layer is never chosen
    monitor = RouterMonitor(model)
    ids = torch.randint(3, 97, (3, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    out = model(ids, attention_mask=mask, labels=ids, output_router_logits=True)
    tokens = dict(monitor.tokens)
    metrics = monitor.collect()
    K = model.config.num_experts_per_tok
    for (name, counts), routes in zip(tokens.items(), out.router_expert_ids):
        short = name.removeprefix("model.").removesuffix(".mlp")
        assert counts.sum().item() == int(mask.sum()) * K
        expected = torch.stack([(routes == e).sum() for e in range(4)]).float()
        assert torch.equal(counts, expected)
        assert metrics[f"load_max_over_mean/{short}"] == pytest.approx((expected.max() / expected.mean()).item())
        assert metrics[f"dead_experts/{short}"] == int((expected == 0).sum())
    assert metrics["dead_experts/layers.0"] == 1


NEW_ROUTING = {
    "sigmoid_groups_bias_global": dict(router_score_function="sigmoid", num_expert_groups=2, topk_expert_groups=1,
                                       router_expert_bias=True, router_aux_loss_scope="global_batch",
                                       routed_scaling_factor=2.0, router_bias_update_rate=0.05),
    "sequence_scope_capacity": dict(router_aux_loss_scope="sequence", capacity_factor=1.0),
}


@pytest.mark.distributed(2)
@pytest.mark.parametrize("name", NEW_ROUTING)
def test_tensor_expert_parallel_new_routing_equals_one_process(name):
    """TP + PPMoE over 2 ranks (every rank routes the same tokens) = one process, through optimizer steps with
    balancing after each (no data-parallel reduce: the ranks see the same batch) and a replayed forward."""
    import sys
    from pathlib import Path

    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
    from equivalence import ATOL, batch, build, lm_step, max_diff

    from hf_ppmoe.parallel import parallelize

    settings = NEW_ROUTING[name]
    ref = build(**settings)
    model = parallelize(build(**settings), dist.group.WORLD)
    balancers = [LoadBalancer(m) for m in (model, ref)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref)]
    for step in range(3):
        ids, mask, labels = batch(seed=step + 1)
        loss, ref_loss = (lm_step(m, ids, mask, labels) for m in (model, ref))
        assert loss == pytest.approx(ref_loss, abs=1e-5), step
        assert max_diff(model, ref) < ATOL, step
        for optimizer, balancer in zip(optimizers, balancers):
            optimizer.step()
            optimizer.zero_grad()
            balancer.step()
    for ours, theirs in zip(gates(model), gates(ref)):
        if theirs.expert_bias is not None:
            assert torch.equal(ours.expert_bias, theirs.expert_bias) and theirs.expert_bias.abs().sum() > 0
    ids, mask, labels = batch(seed=9)
    recorded = ref(input_ids=ids, attention_mask=mask, output_router_logits=True).router_expert_ids
    replayed, ref_replayed = (m(input_ids=ids, attention_mask=mask, labels=labels, router_expert_ids=recorded)
                              for m in (model, ref))
    torch.testing.assert_close(replayed.loss, ref_replayed.loss, atol=1e-5, rtol=0)
    if "capacity_factor" not in settings:  # dropless: replaying the recorded routes is the normal forward
        normal = ref(input_ids=ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(replayed.loss, normal.loss, atol=1e-5, rtol=0)
