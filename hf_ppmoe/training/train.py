"""Training of GPT-MoE (and of dense Transformers baselines) with Accelerate, in named steps:

    setup(args) -> Run              check arguments, data, tokenizer, model, parallelism, `accelerator.prepare`, resume
    forward_backward_step(run, b)   one micro-batch: forward, backward; its (lm, aux, z) losses stay on the device
    train_step(run, step)           one optimizer step: the micro-steps (or one pipeline step), clipping, optimizer
    evaluate(run)                   LM loss and perplexity on the validation batches
    train(args)                     the loop: train_step, then log / evaluate / checkpoint at their intervals; save
    finish(run, evaluation)         chrF / BLEU, the outputs written, the trackers closed, the process group destroyed

The micro-batch step and the evaluation's cross-entropy are `steps.py`'s, which the demo's loop shares. The loop
does no I/O of its own: model and tokenizer come from `build.py`, checkpoints are `checkpoints.py`'s, and the final
model, card, plots and Hub push `output.py`'s.
The data is an object (see `block_data.py`) that hands each data-parallel process its batch for (step, micro-step); with
Accelerate's saved optimizer, scheduler and RNG states, `--resume` continues exactly where an uninterrupted run would
be (what a checkpoint records and the checks that refuse a resume that would not: `checkpoints.py`).

`--tp_size`, `--pp_size`, `--fsdp_size`, `--ep_size` split the model with hf_ppmoe.parallel (`parallel_setup.py`).
Accelerate keeps the loop, accumulation, schedule, RNG states and logging; it cannot wrap or checkpoint a
DTensor-sharded model, so a split model's gradients are averaged by FSDP2 (HSDP with shard groups of one when nothing
is sharded), clipped by the whole model's norm, and model and optimizer are checkpointed with
torch.distributed.checkpoint, every process writing its own shards. The final model is gathered and written by rank 0.
With `--pp_size`, one `Pipeline.step` runs a replica's micro-batches as the pipeline's microbatches.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase, get_scheduler

from ..moe.balance import LoadBalancer
from ..parallel import Pipeline
from ..parallel.fsdp import set_gradient_sync
from ..utils.chat_template import chat_template_text
from .arguments import TrainArguments
from .block_data import PackedData, StreamedData, load_data
from .build import build_model, is_seq2seq, load_tokenizer
from .checkpoints import Checkpointer, check_resume, find_checkpoint, new_run_id, read_checkpoint, run_record
from .consistency import check_processes_agree
from .output import final_model, push, write_outputs
from .pairs import PairData, generate_and_score, load_pairs, pair_data
from .parallel_setup import DataParallelGroup, accelerate_fsdp_request, clip_gradients, split_model
from .steps import forward_backward, token_losses
from .tracking import JSONLinesTracker, RouterMonitor


@dataclass
class Run:
    """What `setup` builds and the steps use."""

    args: TrainArguments
    accelerator: Accelerator
    dp: DataParallelGroup
    model: torch.nn.Module  # what trains: the prepared model, a split model, or the pipeline stage
    optimizer: torch.optim.Optimizer
    scheduler: AcceleratedScheduler
    data: PackedData | StreamedData | PairData  # block_data.py, pairs.py
    tokenizer: PreTrainedTokenizerBase
    monitor: RouterMonitor
    jsonl: JSONLinesTracker
    record: dict  # what every checkpoint records about the run (checkpoints.py)
    checkpointer: Checkpointer
    pipe: Pipeline | None = None  # with --pp_size
    start_step: int = 0
    changes: dict = field(default_factory=dict)
    balancer: LoadBalancer | None = None  # per-step bias balancing and global-batch balance (hf_ppmoe.moe.balance)
    no_target: torch.Tensor = field(init=False)  # micro-batches without a target since the last log (on the device)

    def __post_init__(self):
        self.no_target = torch.zeros((), dtype=torch.long, device=self.device)

    @property
    def config(self):
        return self.pipe.module.model.config if self.pipe else self.accelerator.unwrap_model(self.model).config

    @property
    def device(self) -> torch.device:
        return self.accelerator.device


def setup(args: TrainArguments) -> Run:
    """Everything before the first step, in a fixed order: arguments, data and tokenizer, model, parallelism,
    `accelerator.prepare`, resume."""
    args.validate()
    checkpoint = find_checkpoint(args)
    saved = read_checkpoint(checkpoint) if checkpoint else None  # its files checked before anything is built
    resume_step = saved["step"] if saved else None
    fsdp_note = accelerate_fsdp_request(args, int(os.environ.get("WORLD_SIZE", 1)))
    output_dir = Path(args.output_dir)
    jsonl = JSONLinesTracker("hf-ppmoe", str(output_dir / "logs"), resume_step)  # writes nothing before training
    accelerator = Accelerator(
        # without an accelerator, say so: Accelerate only recognises several CPU processes (torchrun) as data
        # parallel when told it runs on the CPU
        cpu=not torch.accelerator.is_available(),
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # max_steps counts optimizer steps of the global batch: the schedule advances once per step
        step_scheduler_with_optimizer=False,
        log_with=[jsonl] + [name for name in args.report_to if name != "jsonl"],
        project_dir=str(output_dir),
    )
    if fsdp_note:
        accelerator.print(fsdp_note)
    set_seed(args.seed)

    seq2seq = is_seq2seq(args)
    if seq2seq:  # (source, target) pairs: pairs.py
        train_pairs, val_pairs = load_pairs(args)
        tokenizer = load_tokenizer(args, [*train_pairs["source"], *train_pairs["target"]])
    else:
        tokenizer = load_tokenizer(args)
    if args.chat_template is not None:  # saved with the tokenizer into every output folder (`hf-ppmoe serve`)
        tokenizer.chat_template = chat_template_text(args.chat_template)
    model = build_model(args, tokenizer)
    args.check_model(model.config)
    dp = DataParallelGroup(accelerator, args.tp_size, args.pp_size, args.fsdp_size, args.ep_size)
    clock = time.perf_counter()
    if seq2seq:
        data = pair_data(args, tokenizer, train_pairs, val_pairs, dp)
    else:  # prepared once per node (the other processes map the same cache entry), or streamed: see block_data.py
        data = load_data(args, tokenizer, dp.rank, dp.size, accelerator.local_main_process_first)
    accelerator.print(f"data: {data}, ready in {time.perf_counter() - clock:.1f} s")
    check_processes_agree(args, model)
    # a resumed run keeps its checkpoint's run id (the main process's id is the one written)
    record = run_record(args, model.config, data.fingerprint, accelerator.num_processes,
                        (saved or {}).get("run_id") or new_run_id())
    changes = check_resume(saved, record, args.allow_resume_changes) if saved else {}
    if saved:
        record["changes"] = saved.get("changes", []) + ([{"step": resume_step, "changed": changes}] if changes else [])
    model.train()
    monitor, balancer = RouterMonitor(model), LoadBalancer(model)
    model, pipe = split_model(model, args, dp, monitor)  # with tp/pp/fsdp/ep sizes: see parallel_setup.py

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
    )
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, args.warmup_steps, args.max_steps)
    sharded = None
    if dp.mesh is None:
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    else:  # see the module docstring
        scheduler, sharded = accelerator.prepare(scheduler), (model, optimizer, pipe.rank if pipe else None)
    checkpointer = Checkpointer(accelerator, args.output_dir, record, sharded, data)
    run = Run(args, accelerator, dp, model, optimizer, scheduler, data, tokenizer, monitor, jsonl, record, checkpointer,
              pipe, changes=changes, balancer=balancer)
    if balancer.layers:  # its global-batch fractions are training state (the bias is saved with the model)
        accelerator.register_for_checkpointing(balancer)
    if checkpoint is not None:
        checkpointer.load(checkpoint)
        run.start_step = resume_step
        accelerator.print(f"resumed from {checkpoint} at step {resume_step}")
    return run


def forward_backward_step(run: Run, batch: dict) -> torch.Tensor:
    """One micro-batch (`steps.forward_backward`): forward and backward. Returns its detached (lm, aux, z) losses, on
    the device; a micro-batch without a target adds nothing and is counted in `train/no_target_batches`."""
    batch = {name: tensor.to(run.device) for name, tensor in batch.items()}
    losses = forward_backward(run.model, batch, not run.config.is_encoder_decoder, run.accelerator.backward,
                              run.accelerator.autocast)
    run.no_target += losses[3] == 0
    return losses[:3]


def train_step(run: Run, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step (`step` counts from 0). Returns the step's (lm, aux, z) losses averaged over micro-steps and
    data-parallel processes, and the gradient norm before clipping; both stay on the device."""
    args, accumulation = run.args, run.args.gradient_accumulation_steps
    if run.pipe is not None:  # the micro-steps' rows in one batch, the pipeline's microbatches
        batch = torch.cat([run.data.batch(step, m)["input_ids"] for m in range(accumulation)]).to(run.device)
        with run.accelerator.autocast():
            run.pipe.step(batch, batch)
        grad_norm = clip_gradients(run.model, args.max_grad_norm, run.dp, run.pipe)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        sums = torch.stack([run.pipe.losses[name] for name in ("lm", "aux", "z")])
    else:
        sums, grad_norm = torch.zeros(3, device=run.device), None
        for micro in range(accumulation):
            with run.accelerator.accumulate(run.model):
                set_gradient_sync(run.model, run.accelerator.sync_gradients)  # FSDP: reduce on the last micro-step
                sums += forward_backward_step(run, run.data.batch(step, micro)) / accumulation
                if run.accelerator.sync_gradients:
                    grad_norm = clip_gradients(run.model, args.max_grad_norm, run.dp)
                    run.optimizer.step()
                    run.optimizer.zero_grad(set_to_none=True)
    run.balancer.step(run.dp.reduce)  # the step's routes over all micro-batches and data-parallel processes
    run.scheduler.step()
    return run.dp.reduce(sums, reduction="mean"), grad_norm  # the same on every rank: all stop together


@torch.no_grad()
def evaluate(run: Run) -> dict:
    """Token-weighted LM cross-entropy (`steps.token_losses`: no router losses) over the validation batches, split
    across data-parallel processes (with a pipeline, the stages run forward one after another; the last computes the
    loss)."""
    model, dp, pipe = run.model, run.dp, run.pipe
    model.eval()
    # forward through the model itself, not its DDP wrapper: a process may have fewer evaluation batches than another
    # (or none), and DDP's forward runs a collective (the buffer broadcast) that the others would never join
    forward = model if pipe is not None else run.accelerator.unwrap_model(model)
    mine = run.data.validation_batches()
    rounds = len(mine)
    if dp.sharded:  # every forward is a collective of all data-parallel processes: all run the same number of them
        total_batches = int(dp.reduce(torch.tensor([len(mine)], device=run.device)).item())
        rounds = -(-total_batches // dp.size)
    total = torch.zeros(2, device=run.device)  # cross-entropy sum, target tokens
    causal = not run.config.is_encoder_decoder
    for r in range(rounds):
        batch = mine[r] if r < len(mine) else (mine or [spare_batch(run)])[0]  # extra forwards are not counted
        input_ids, labels = batch["input_ids"].to(run.device), batch["labels"].to(run.device)
        with run.accelerator.autocast():
            if pipe is not None:  # (a mean over `count` tokens, count) on the last stage, None on the others
                lm, count = pipe.lm_loss(input_ids, labels) or (None, None)
                sums = None if lm is None else torch.stack([torch.where(count > 0, lm.float() * count, 0.0), count.float()])
            else:
                extra = {} if causal else {"attention_mask": batch["attention_mask"].to(run.device)}
                losses, targets = token_losses(forward, input_ids, labels, causal, **extra)
                sums = torch.stack([losses[targets].sum(), targets.sum().float()])
        if sums is not None and r < len(mine):  # not a pipeline's earlier stage, nor a forward that only keeps step
            total += sums
    if pipe is not None:
        dist.all_reduce(total, group=pipe.group)
    total = dp.reduce(total)
    model.train()
    loss = (total[0] / total[1].clamp(min=1)).item()
    return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}


def spare_batch(run: Run) -> dict:
    """A batch of the training shape for forwards that are not counted (not read from the data: a stream would move)."""
    ids = torch.zeros(run.args.per_device_train_batch_size, run.args.block_size, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def log_metrics(run: Run, done: int, interval: torch.Tensor, steps: int, grad_norm, seconds: float) -> dict:
    """The logging interval's means (one read from the device), router metrics, learning rate and tokens/s."""
    dp, pipe = run.dp, run.pipe
    router = run.monitor.collect(lambda t: dp.reduce(t.to(run.device)))  # over the logging interval
    if pipe is not None:  # every stage has its own layers' metrics
        stages = [None] * pipe.size
        dist.all_gather_object(stages, router, group=pipe.group)
        router = {name: value for stage in stages for name, value in stage.items()}
    lm, aux, z = (interval / steps).tolist()
    no_target = int(dp.reduce(run.no_target))
    run.no_target.zero_()
    args = run.args
    per_row = getattr(run.data, "tokens_per_row", args.block_size)  # pairs: their mean source + target length
    tokens = args.per_device_train_batch_size * dp.size * args.gradient_accumulation_steps * per_row * steps
    metrics = {
        "train/lm_loss": lm, "train/aux_loss": aux, "train/z_loss": z, "train/grad_norm": grad_norm.item(),
        "train/lr": run.scheduler.get_last_lr()[0], "train/tokens_per_second": tokens / seconds,
        "train/no_target_batches": no_target, **router,
    }
    run.accelerator.log(metrics, step=done)
    return metrics


def train(args: TrainArguments) -> dict:
    """Train; returns a summary (final step, eval loss, output folder). See `python -m hf_ppmoe.training --help`."""
    run = setup(args)
    accelerator = run.accelerator
    # training starts: from here on the output folder's logs are this run's
    accelerator.init_trackers("hf-ppmoe", config={**json.loads(args.to_json()), "run_id": run.record["run_id"]})
    if run.changes:
        accelerator.print(f"warning: resumed with changed settings (--allow_resume_changes): {run.changes}")
        if accelerator.is_main_process:
            run.jsonl.log({"resumed_with_changes": run.changes}, step=run.start_step)
    bar = tqdm(range(run.start_step, args.max_steps), initial=run.start_step, total=args.max_steps,
               disable=not accelerator.is_local_main_process, desc="training", dynamic_ncols=True)
    clock, eval_metrics = time.perf_counter(), {}
    # The loop reads from the device only where it must (logging, evaluation, checkpoints, the last step): the steps
    # between make no host sync, so a GPU runs ahead of Python. The losses add up on the device, and so does the first
    # step whose loss is not finite.
    interval, interval_start = torch.zeros(3, device=run.device), run.start_step
    first_nonfinite = torch.zeros((), dtype=torch.long, device=run.device)  # 0: none yet
    for step in bar:
        sums, grad_norm = train_step(run, step)
        done = step + 1
        first_nonfinite = torch.where((first_nonfinite == 0) & ~torch.isfinite(sums).all(), done, first_nonfinite)
        interval += sums
        log_now = done % args.logging_steps == 0 or done == args.max_steps
        eval_now = done % args.eval_steps == 0 or done == args.max_steps
        save_now = bool(args.checkpointing_steps) and done % args.checkpointing_steps == 0
        if not (log_now or eval_now or save_now):
            continue
        if nonfinite := int(first_nonfinite):
            lm, aux, z = sums.tolist()
            raise FloatingPointError(
                f"Training stopped at step {done}: the loss is not finite since step {nonfinite} (lm {lm}, aux {aux}, "
                f"z {z} at step {done}). Nothing was saved from step {nonfinite} on; checkpoints written before it are "
                "intact. Lower --learning_rate, keep --max_grad_norm on, or try --mixed_precision bf16 instead of fp16."
            )
        if log_now:
            metrics = log_metrics(run, done, interval, done - interval_start, grad_norm, time.perf_counter() - clock)
            bar.set_postfix(loss=f"{metrics['train/lm_loss']:.3f}", aux=f"{metrics['train/aux_loss']:.3f}",
                            tok_s=f"{metrics['train/tokens_per_second']:,.0f}")
            interval.zero_()
            interval_start, clock = done, time.perf_counter()
        paused = time.perf_counter()  # evaluation and checkpoints do not count in the next interval's tokens/s
        if eval_now:
            eval_metrics = evaluate(run)
            accelerator.log(eval_metrics, step=done)
        if save_now:
            run.checkpointer.save(done)
        clock += time.perf_counter() - paused
    eval_metrics = finish(run, eval_metrics)
    if eval_metrics:
        m = eval_metrics
        generated = f"; chrF {m['eval/chrf']:.2f}, BLEU {m['eval/bleu']:.2f} (flat beam search)" if "eval/chrf" in m else ""
        accelerator.print(f"step {args.max_steps}: eval loss {m['eval/loss']:.4f}, perplexity {m['eval/perplexity']:.2f} "
                          f"(LM cross-entropy on the held-out data, router losses excluded){generated}")
    output_dir = Path(args.output_dir)
    accelerator.print(f"saved to {output_dir.resolve()}" + (f" (plots in {output_dir / 'plots'})" if args.plots else ""))
    return {"step": args.max_steps, **eval_metrics, "output_dir": str(output_dir)}


def finish(run: Run, evaluation: dict) -> dict:
    """After the last step: the final model's chrF / BLEU (a Seq2Seq-MoE), the outputs written (output.py), the
    trackers closed and the process group destroyed (`end_training`), then the Hub push. Returns the evaluation."""
    accelerator = run.accelerator
    accelerator.wait_for_everyone()
    run.monitor.remove()
    model = final_model(run)
    if accelerator.is_main_process and model.config.is_encoder_decoder:  # flat-beam-search outputs, whole model
        evaluation = {**evaluation, **generate_and_score(model, run)}
        accelerator.log(evaluation, step=run.args.max_steps)
    write_outputs(run, model, evaluation)
    accelerator.end_training()
    if run.args.push_to_hub and accelerator.is_main_process:
        push(run.args)
    return evaluation


main = train  # the package's entry point name
