"""Transformers' `Trainer` / `Seq2SeqTrainer` on our models: the LM, aux and z losses logged apart, the router
statistics of every MoE layer, and evaluation perplexity from the LM loss alone.

    from hf_ppmoe.training import MoETrainer        # or MoESeq2SeqTrainer, or MoETrainerMixin for your own Trainer
    trainer = MoETrainer(model=model, args=TrainingArguments(...), train_dataset=..., eval_dataset=...)
    trainer.train()      # logs loss, lm_loss, aux_loss, z_loss, expert_load_cv/<layer>, dropped_fraction/<layer>
    trainer.evaluate()   # eval_loss (the model's loss: with the router terms), eval_lm_loss, eval_perplexity, ...

Why a Trainer mixin rather than a callback: a `TrainerCallback` sees neither the model's outputs nor a way to add
values to a log entry (`Trainer.log` stores the entry in `state.log_history` and hands it to the reporting callbacks,
TensorBoard, W&B, the progress bar, before a user's callback gets it). `Trainer.log` and `Trainer.evaluation_loop` are
overridable for exactly this ("subclass and override to inject custom behavior"; TRL's SFTTrainer adds its metrics the
same way), and the mixin overrides only those two. The values come from what the model returns (`lm_loss`,
`num_target_tokens`, `aux_loss`, `z_loss`) through a forward hook on the model Trainer calls (PEFT included), not from
`compute_loss`: the hook sees the model's fields whatever Trainer later does to `loss`, and the arguments they were
computed from (`num_items_in_batch`), and it works under any `compute_loss` a subclass brings.

What is logged, every logging step and for every evaluation (prefixed `eval_`), over all micro-batches and processes:
- `lm_loss`: the cross-entropy per label token (no router terms); at evaluation also `perplexity` = exp(`eval_lm_loss`).
  Trainer's own `loss` / `eval_loss` is the model's loss, LM plus the weighted router losses.
- `aux_loss`, `z_loss`: the router losses (means over the MoE layers, as in the model output), weighted by each
  micro-batch's label tokens, as their gradient is (`hf_ppmoe.modeling.loss.router_loss_weight`); with equally long
  micro-batches, `loss = lm_loss + moe.losses.router_loss(config, aux_loss, z_loss)`.
- `expert_load_cv/<layer>`, `dropped_fraction/<layer>`: `RouterMonitor`'s statistics, as `python -m hf_ppmoe.training`
  logs them.
- With `router_expert_bias` or `router_aux_loss_scope="global_batch"`, the gates' per-step state is updated after
  every optimizer step (`BalanceAfterOptimizerStep`, `hf_ppmoe.moe.balance.LoadBalancer`); the bias is saved with the
  model, the global-batch fractions are not (a resumed run uses its first micro-batch's until one step is done).
- `no_target_batches`: the micro-batches whose labels have no target token (all -100, or one-token sequences, which a
  causal LM cannot predict). The model gives them a loss of 0 and no gradient, so they neither stop nor poison a run;
  Trainer's `loss` counts them as 0. Counted on the device, as `python -m hf_ppmoe.training` counts them.
Only forwards given `labels` count for the losses (with a `compute_loss_func` or label smoothing the model gets no
labels and only the router statistics are logged). Not covered: `use_legacy_prediction_loop`, and several GPUs in one
process (`torch.nn.DataParallel`, which Trainer uses when it sees several GPUs without a launcher: its replicas would
run the hook concurrently); launch one process per GPU (torchrun / accelerate launch) as usual.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from transformers import Seq2SeqTrainer, Trainer, TrainerCallback

from ..modeling import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from ..moe.balance import LoadBalancer
from .steps import forward_losses
from .tracking import RouterMonitor


class LossMonitor:
    """A forward hook on `model` (what Trainer calls: our model, or a PEFT model around `moe_model`) that sums, over the
    forwards given labels, the LM cross-entropy, the label tokens, the token-weighted aux and z losses and the forwards
    without a target token, on the device, until `collect()`. It observes the model's losses, not routing (which
    `RouterMonitor` reads through `hf_ppmoe.moe.observe`): see that module's docstring for why it stays apart."""

    def __init__(self, model: torch.nn.Module, moe_model: torch.nn.Module):
        self.config = moe_model.config
        self.sums = None  # [cross-entropy sum, label tokens, tokens x aux, tokens x z, forwards without a target]
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    @torch.no_grad()
    def _hook(self, module, args, kwargs, output):
        labels = kwargs.get("labels")
        if labels is None or getattr(output, "lm_loss", None) is None or getattr(output, "aux_loss", None) is None:
            return
        lm, aux, z, tokens = forward_losses(output, labels, not self.config.is_encoder_decoder)  # steps.py, as train.py
        num_items = kwargs.get("num_items_in_batch")
        # the model's LM loss: a mean over `tokens`, or a sum divided by num_items_in_batch
        cross_entropy = lm * (num_items if num_items is not None else tokens)
        sums = torch.stack([cross_entropy, tokens, tokens * aux, tokens * z, tokens == 0]).float()
        self.sums = sums if self.sums is None else self.sums + sums.to(self.sums.device)

    @contextmanager
    def separately(self):
        """As `RouterMonitor.separately`."""
        saved, self.sums = self.sums, None
        try:
            yield
        finally:
            self.sums = saved

    def collect(self, reduce, device) -> dict[str, float]:
        """Token-weighted means since the last collect, summed over processes by `reduce` (every process calls it),
        and the count of forwards without a target; empty when no forward had a label."""
        sums = reduce(self.sums.to(device) if self.sums is not None else torch.zeros(5, device=device))
        self.sums, (ce, tokens, aux, z, no_target) = None, sums.tolist()
        if tokens == 0:
            return {"no_target_batches": int(no_target)} if no_target else {}
        return {"lm_loss": ce / tokens, "aux_loss": aux / tokens, "z_loss": z / tokens, "no_target_batches": int(no_target)}

    def remove(self):
        self.handle.remove()


class MoETrainerMixin:
    """Put before `Trainer` (or a subclass of it) in the bases: `class MyTrainer(MoETrainerMixin, Trainer)`. See the
    module docstring for what it logs and why it is a mixin."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.model is None:
            raise ValueError(f"{type(self).__name__} needs `model=` (`model_init` is not supported).")
        moe_models = [m for m in self.model.modules() if isinstance(m, (GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration))]
        if len(moe_models) != 1:
            raise ValueError(
                f"{type(self).__name__} logs the router losses and statistics of one GPTMoEForCausalLM or "
                f"Seq2SeqMoEForConditionalGeneration (possibly inside a PEFT model); {type(self.model).__name__} holds "
                f"{len(moe_models)}. Use transformers.Trainer for other models."
            )
        if self.args.dataloader_pin_memory and not torch.accelerator.is_available():
            # pinned memory only speeds copies to an accelerator; without one, torch's DataLoader warns on every epoch
            self.args.dataloader_pin_memory = False
        self.loss_monitor = LossMonitor(self.model, moe_models[0])
        self.router_monitor = RouterMonitor(moe_models[0])
        self.load_balancer = LoadBalancer(moe_models[0])
        if self.load_balancer.layers:  # router_expert_bias or the global-batch balance loss
            self.add_callback(BalanceAfterOptimizerStep(self))

    def _moe_metrics(self, prefix: str = "") -> dict[str, float]:
        """What the monitors gathered since they were last collected, over all processes (every process calls this)."""
        device = self.args.device

        def reduce(tensor):
            return self.accelerator.reduce(tensor.to(device), reduction="sum")

        metrics = self.loss_monitor.collect(reduce, device)
        if prefix and "lm_loss" in metrics:
            metrics["perplexity"] = math.exp(metrics["lm_loss"]) if metrics["lm_loss"] < 700 else math.inf
        metrics.update(self.router_monitor.collect(reduce))
        return {f"{prefix}{name}": value for name, value in metrics.items()}

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:  # a training log entry (evaluation metrics are added in evaluation_loop)
            logs.update(self._moe_metrics())
        super().log(logs, *args, **kwargs)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"):
        # kept apart from the training statistics of the current logging interval, which go on after the evaluation
        with self.loss_monitor.separately(), self.router_monitor.separately():
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
            output.metrics.update(self._moe_metrics(f"{metric_key_prefix}_"))
        return output


class BalanceAfterOptimizerStep(TrainerCallback):
    """After every optimizer step, `LoadBalancer.step` over all processes (`hf_ppmoe.moe.balance`): the expert
    biases and global-batch balance fractions. A callback, as Trainer announces the optimizer step to callbacks only."""

    def __init__(self, trainer: MoETrainerMixin):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        trainer = self.trainer
        trainer.load_balancer.step(lambda t: trainer.accelerator.reduce(t.to(trainer.args.device), reduction="sum"))


class MoETrainer(MoETrainerMixin, Trainer):
    """`transformers.Trainer` with the MoE metrics of `MoETrainerMixin`."""


class MoESeq2SeqTrainer(MoETrainerMixin, Seq2SeqTrainer):
    """`transformers.Seq2SeqTrainer` with the MoE metrics of `MoETrainerMixin`."""
