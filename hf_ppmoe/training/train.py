"""Causal-LM training of GPT-MoE (and of dense Transformers baselines) with Accelerate: `main(args)`.

Order of work (STYLE lesson 12): check arguments -> data and tokenizer -> build, load or upcycle the model ->
apply parallelism -> `accelerator.prepare` -> train (evaluate, log, checkpoint) -> save, plot, push.

Data order is a pure function of (seed, step): the global batch of step s is the s-th slice of per-epoch seeded
permutations, cut into micro-batches and data-parallel shards. Together with Accelerate's saved optimizer,
scheduler and RNG states, `--resume` therefore continues exactly where an uninterrupted run would be; what a
checkpoint records about its run, and the checks that refuse a resume that would not continue it, are in
`checkpoints.py`.

`--tp_size`, `--pp_size`, `--fsdp_size` and `--ep_size` split the model over the processes with hf_ppmoe.parallel
(`parallel_setup.py`: tensor parallelism with PPMoE expert parallelism, pipeline stages, FSDP2 / HSDP, experts over
several tensor-parallel groups). Accelerate keeps the loop, gradient accumulation, the schedule, RNG states, logging;
it cannot wrap or checkpoint a DTensor-sharded model (its DDP refuses DTensors, its TP support composes only with
FSDP2, and `save_state` writes model and optimizer from the main process alone), so a split model's data-parallel
processes (replicas, FSDP ranks) average their gradients through FSDP2 (HSDP with shard groups of one when nothing
is sharded), the gradients are clipped by the whole model's norm (`parallel_setup.clip_grad_norm_`), and model and
optimizer are checkpointed with torch.distributed.checkpoint, every process writing its own shards. The final model
is gathered (every shard, every stage) and written whole by rank 0. Evaluation of a sharded model runs every
forward on every data-parallel process (FSDP's all-gathers are collectives), counting only its own batches.

`--pp_size P` (GPT-MoE) cuts the model into P stages (`hf_ppmoe.parallel.Pipeline`). A replica's batch for an
optimizer step is the rows its micro-steps would have read, concatenated; one `Pipeline.step` runs them as the
pipeline's microbatches (1F1B, or GPipe when there are fewer microbatches than stages). The norm sums the stages'
(a parameter several stages hold counted once); evaluation runs the stages forward one after another
(`Pipeline.forward`); router metrics come from every stage. Checkpoints hold each stage's model and optimizer under
its own key.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, set_seed
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_scheduler

from ..modeling import GPTMoEConfig, GPTMoEForCausalLM
from ..parallel.checkpoint import load_distributed_checkpoint
from ..parallel.data_parallel import set_gradient_sync
from ..utils.atomic import atomic_folder
from ..utils.model_card import training_card, write_card
from .arguments import TrainArguments
from .checkpoints import CHECKPOINT_PREFIX, check_resume, find_checkpoint, new_run_id, read_checkpoint, run_record, write_state
from .consistency import check_processes_agree
from .data import builtin_corpus, pack, read_dataset, read_text_files, train_tokenizer
from .parallel_setup import DataParallel, clip_grad_norm_, gather_model, split_model
from .tracking import JSONLinesTracker, RouterMonitor, plot_training


def load_texts(args: TrainArguments) -> tuple[list[str], list[str] | None]:
    if args.train_file:
        train = read_text_files(args.train_file, args.text_column)
    elif args.dataset_name:
        train = read_dataset(args.dataset_name, args.dataset_config_name, args.dataset_split, args.text_column)
    else:
        train = builtin_corpus()
    validation = read_text_files(args.validation_file, args.text_column) if args.validation_file else None
    if not train:
        raise ValueError("The training data has no documents.")
    return train, validation


def load_tokenizer(args: TrainArguments, texts: list[str]):
    source = args.tokenizer_name or args.model_name_or_path or args.upcycle_from
    if source:
        try:
            return AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError):
            if args.tokenizer_name:
                raise
    return train_tokenizer(texts)  # a model trained from scratch gets a BPE tokenizer fitted to its data


def build_model(args: TrainArguments, tokenizer):
    """Our GPT-MoE (loaded, from a config, upcycled, or the default small one), or any Transformers causal LM (a
    dense baseline trained by the same script; it simply has no router metrics)."""
    if args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    elif args.upcycle_from:
        from ..conversion import upcycle

        model = upcycle(
            args.upcycle_from,
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            router_type=args.router_type,
            router_init=args.router_init,
            noise_std=args.expert_noise_std,
            seed=args.seed,
        )
    elif args.config_name:  # any causal-LM config.json (model_type decides the class), with the tokenizer's ids
        config = AutoConfig.from_pretrained(args.config_name)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            setattr(config, name, getattr(tokenizer, name))
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = GPTMoEForCausalLM(
            GPTMoEConfig(
                vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=4, max_position_embeddings=max(512, args.block_size),
                num_experts=args.num_experts, num_experts_per_tok=args.num_experts_per_tok, router_type=args.router_type,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
            )
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder; this script trains causal LMs on packed text. Fine-tune "
            "Seq2Seq-MoE with transformers' Seq2SeqTrainer on (source, target) pairs."
        )
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {model.config.vocab_size}; "
            "use the model's own tokenizer (--tokenizer_name) or resize the embeddings first."
        )
    return model


def batch_indices(step: int, micro: int, process: int, args: TrainArguments, world: int, n_blocks: int) -> torch.Tensor:
    """Rows of the training blocks for (optimizer step, micro-step, data-parallel process)."""
    b = args.per_device_train_batch_size
    start = (step * args.gradient_accumulation_steps + micro) * world * b + process * b
    positions = torch.arange(start, start + b)
    epochs, offsets = positions // n_blocks, positions % n_blocks
    rows = torch.empty(b, dtype=torch.long)
    for epoch in range(start // n_blocks, (start + b - 1) // n_blocks + 1):  # the epochs these b positions span
        perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(args.seed * 100_003 + epoch))
        rows[epochs == epoch] = perm[offsets[epochs == epoch]]
    return rows


SHARDED = "sharded_model_optimizer"  # a checkpoint's subfolder for a split model (tp/pp/fsdp) and its optimizer


def sharded_state(model, optimizer, stage: int | None = None) -> dict:
    """Model and optimizer state for torch.distributed.checkpoint; a pipeline stage's under its own key (the stages
    number their layers from 0 alike; the replicas of a stage write it once)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    return state if stage is None else {f"stage_{stage}": state}


def save_checkpoint(accelerator: Accelerator, args: TrainArguments, step: int, record: dict, sharded=None) -> None:
    """Accelerate state into a temporary folder that replaces checkpoints/step_N in one step when complete
    (hf_ppmoe.utils.atomic: a killed or failed save leaves no checkpoint, or the earlier one of that step), with
    the run's `record` (hf_ppmoe.training.checkpoints). sharded: (model, optimizer, pipeline stage or None) that
    Accelerate does not hold (tensor / pipeline parallel), saved by every process."""
    final = Path(args.output_dir, "checkpoints", f"{CHECKPOINT_PREFIX}{step}")
    with atomic_folder(final, overwrite=True) if accelerator.is_main_process else nullcontext() as staging:
        (staging,) = broadcast_object_list([staging])  # the main process's temporary folder, written by all
        accelerator.save_state(str(staging))
        if sharded is not None:
            dcp.save(sharded_state(*sharded), checkpoint_id=staging / SHARDED)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_state(staging, step, record)
    accelerator.wait_for_everyone()


def load_sharded(path: Path, model, optimizer, stage: int | None = None) -> None:
    state = sharded_state(model, optimizer, stage)
    load_distributed_checkpoint(state, path)
    state = state if stage is None else state[f"stage_{stage}"]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, args: TrainArguments, accelerator: Accelerator, dp: DataParallel, pipe=None):
    """Token-weighted LM cross-entropy (no router losses) over the validation blocks, split across replicas (with
    `pipe`, `model` is its stage: the stages run forward one after another, the last one computes the loss)."""
    model.eval()
    # forward through the model itself, not its DDP wrapper: a replica may have fewer evaluation batches than another
    # (or none), and DDP's forward runs a collective (the buffer broadcast) that the others would never join
    forward = model if pipe is not None else accelerator.unwrap_model(model)
    b = args.per_device_train_batch_size
    batches = list(range(0, len(blocks), b))
    if args.eval_batches:
        batches = batches[: args.eval_batches]
    mine = batches[dp.rank :: dp.size]
    # a sharded model's forward is a collective of all data-parallel processes: one with fewer batches runs the
    # others' extra forwards on its first batch (or the first one) and does not count them
    rounds = -(-len(batches) // dp.size) if dp.sharded else len(mine)
    total = torch.zeros(2, device=accelerator.device)
    for r in range(rounds):
        i = mine[r] if r < len(mine) else batches[0]
        batch = blocks[i : i + b].to(accelerator.device)
        with accelerator.autocast():
            logits = forward(batch).logits if pipe is None else pipe.forward(batch)
        if logits is None or r >= len(mine):  # not the pipeline's last stage, or a forward that only keeps step
            continue
        logits = (logits.full_tensor() if isinstance(logits, DTensor) else logits).float()
        total[0] += F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total[1] += batch[:, 1:].numel()
    if pipe is not None:
        dist.all_reduce(total, group=pipe.group)
    total = dp.reduce(total)
    model.train()
    loss = (total[0] / total[1].clamp(min=1)).item()
    return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}


def main(args: TrainArguments) -> dict:
    """Train; returns a summary (final step, eval loss, output folder). See `python -m hf_ppmoe.training --help`."""
    args.validate()
    checkpoint = find_checkpoint(args)
    saved = read_checkpoint(checkpoint) if checkpoint else None  # its files checked before anything is built
    resume_step = saved["step"] if saved else None
    output_dir = Path(args.output_dir)
    jsonl = JSONLinesTracker("hf-ppmoe", str(output_dir / "logs"), resume_step)  # writes nothing before training
    trackers = [jsonl] + [name for name in args.report_to if name != "jsonl"]
    accelerator = Accelerator(
        # without an accelerator, say so: Accelerate only recognises several CPU processes (torchrun) as data
        # parallel when told it runs on the CPU
        cpu=not torch.accelerator.is_available(),
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # max_steps counts optimizer steps of the global batch: the schedule advances once per step, whatever the
        # number of processes (by default Accelerate would step it once per process)
        step_scheduler_with_optimizer=False,
        log_with=trackers,
        project_dir=str(output_dir),
    )
    set_seed(args.seed)

    train_texts, val_texts = load_texts(args)
    tokenizer = load_tokenizer(args, train_texts)
    blocks = pack(train_texts, tokenizer, args.block_size)
    if val_texts is not None:
        val_blocks = pack(val_texts, tokenizer, args.block_size)
    else:
        n_val = max(1, len(blocks) // 20)
        blocks, val_blocks = blocks[:-n_val], blocks[-n_val:]
    if len(blocks) == 0:
        raise ValueError(f"Not enough training text for one block of {args.block_size} tokens after holding out validation.")

    model = build_model(args, tokenizer)
    args.check_model(model.config)
    dp = DataParallel(accelerator, args.tp_size, args.pp_size, args.fsdp_size, args.ep_size)
    check_processes_agree(args, model)
    # a resumed run keeps its checkpoint's run id (the main process's id is the one written)
    run_id = (saved or {}).get("run_id") or new_run_id()
    record = run_record(args, model.config, blocks, accelerator.num_processes, run_id)
    changes = check_resume(saved, record, args.allow_resume_changes) if saved else {}
    if saved:
        record["changes"] = saved.get("changes", []) + ([{"step": resume_step, "changed": changes}] if changes else [])
    model.train()
    monitor = RouterMonitor(model)
    model, pipe = split_model(model, args, dp, monitor)  # with tp/pp/fsdp/ep sizes: see parallel_setup.py

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, args.warmup_steps, args.max_steps)
    sharded = None
    if dp.mesh is None:
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    else:  # see the module docstring
        scheduler, sharded = accelerator.prepare(scheduler), (model, optimizer, pipe.rank if pipe else None)
    start_step = 0
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))
        if sharded is not None:
            load_sharded(checkpoint / SHARDED, *sharded)
        start_step = resume_step
        accelerator.print(f"resumed from {checkpoint} at step {start_step}")
    # training starts: from here on the output folder's logs are this run's
    accelerator.init_trackers("hf-ppmoe", config={**json.loads(args.to_json()), "run_id": record["run_id"]})
    if changes:
        accelerator.print(f"warning: resumed with changed settings (--allow_resume_changes): {changes}")
        if accelerator.is_main_process:
            jsonl.log({"resumed_with_changes": changes}, step=start_step)

    config = pipe.module.model.config if pipe else accelerator.unwrap_model(model).config
    tokens_per_step = args.per_device_train_batch_size * dp.size * args.gradient_accumulation_steps * args.block_size
    bar = tqdm(range(start_step, args.max_steps), initial=start_step, total=args.max_steps,
               disable=not accelerator.is_local_main_process, desc="training", dynamic_ncols=True)
    clock, eval_metrics = time.perf_counter(), {}
    # The loop reads from the device only where it must (logging, evaluation, checkpoints, the last step): the steps
    # between make no host sync, so a GPU runs ahead of Python. Meanwhile the losses add up on the device, and so does
    # the first step whose loss is not finite.
    interval, interval_start = torch.zeros(3, device=accelerator.device), start_step
    first_nonfinite = torch.zeros((), dtype=torch.long, device=accelerator.device)  # 0: none yet
    for step in bar:
        if pipe is not None:  # the micro-steps' rows in one batch, the pipeline's microbatches
            rows = [batch_indices(step, m, dp.rank, args, dp.size, len(blocks)) for m in range(args.gradient_accumulation_steps)]
            batch = blocks[torch.cat(rows)].to(accelerator.device)
            with accelerator.autocast():
                pipe.step(batch, batch)
            grad_norm = clip_grad_norm_(model, args.max_grad_norm, dp, pipe)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sums = torch.stack([pipe.losses[name] for name in ("lm", "aux", "z")])
        else:
            sums = torch.zeros(3, device=accelerator.device)  # lm, aux, z (means over micro-steps)
            grad_norm = None
            for micro in range(args.gradient_accumulation_steps):
                batch = blocks[batch_indices(step, micro, dp.rank, args, dp.size, len(blocks))].to(accelerator.device)
                with accelerator.accumulate(model):
                    set_gradient_sync(model, accelerator.sync_gradients)  # FSDP: reduce on the last micro-step only
                    with accelerator.autocast():
                        out = model(batch, labels=batch)
                    accelerator.backward(out.loss)
                    if accelerator.sync_gradients:
                        grad_norm = clip_grad_norm_(model, args.max_grad_norm, dp)
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                aux, z = (getattr(out, name, None) for name in ("aux_loss", "z_loss"))  # absent in dense models
                aux = aux.detach() if aux is not None else torch.zeros((), device=accelerator.device)
                z = z.detach() if z is not None else torch.zeros((), device=accelerator.device)
                lm = out.loss.detach() - getattr(config, "router_aux_loss_coef", 0) * aux - getattr(config, "router_z_loss_coef", 0) * z
                sums += torch.stack([lm, aux, z]) / args.gradient_accumulation_steps
        scheduler.step()
        done = step + 1
        sums = dp.reduce(sums, reduction="mean")  # the same on every rank: all stop together, nothing is saved
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
            router = monitor.collect(lambda t: dp.reduce(t.to(accelerator.device)))  # over the logging interval
            if pipe is not None:  # every stage has its own layers' metrics
                stages = [None] * pipe.size
                dist.all_gather_object(stages, router, group=pipe.group)
                router = {name: value for stage in stages for name, value in stage.items()}
            steps = done - interval_start
            lm, aux, z = (interval / steps).tolist()  # means over the interval's steps
            elapsed = time.perf_counter() - clock  # after the read above: the device has finished these steps
            metrics = {
                "train/lm_loss": lm, "train/aux_loss": aux, "train/z_loss": z, "train/grad_norm": grad_norm.item(),
                "train/lr": scheduler.get_last_lr()[0], "train/tokens_per_second": tokens_per_step * steps / elapsed,
                **router,
            }
            accelerator.log(metrics, step=done)
            bar.set_postfix(loss=f"{lm:.3f}", aux=f"{aux:.3f}", tok_s=f"{tokens_per_step * steps / elapsed:,.0f}")
            interval.zero_()
            interval_start, clock = done, time.perf_counter()
        paused = time.perf_counter()  # evaluation and checkpoints do not count in the next interval's tokens/s
        if eval_now:
            eval_metrics = evaluate(model, val_blocks, args, accelerator, dp, pipe)
            accelerator.log(eval_metrics, step=done)
        if save_now:
            save_checkpoint(accelerator, args, done, record, sharded)
        clock += time.perf_counter() - paused

    accelerator.wait_for_everyone()
    monitor.remove()
    if dp.mesh is not None:  # the whole model, on rank 0
        unwrapped = gather_model(model, dp, pipe)
        if accelerator.is_main_process:
            unwrapped.save_pretrained(output_dir)
    else:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
        write_card(output_dir, training_card(
            unwrapped, name=output_dir.resolve().name, source=args.model_name_or_path or args.upcycle_from,
            datasets=[args.dataset_name], evaluation=eval_metrics,
        ))
        if args.plots:
            plot_training(output_dir / "logs" / "metrics.jsonl", output_dir / "plots")
    accelerator.end_training()
    if args.push_to_hub and accelerator.is_main_process:
        push(args)
    if eval_metrics:
        accelerator.print(
            f"step {args.max_steps}: eval loss {eval_metrics['eval/loss']:.4f}, perplexity "
            f"{eval_metrics['eval/perplexity']:.2f} (LM cross-entropy on the held-out blocks, router losses excluded)"
        )
    accelerator.print(f"saved to {output_dir.resolve()}" + (f" (plots in {output_dir / 'plots'})" if args.plots else ""))
    return {"step": args.max_steps, **eval_metrics, "output_dir": str(output_dir)}


def push(args: TrainArguments) -> None:
    """Upload the output folder as it was saved (model, tokenizer, model card, logs and plots; not the checkpoints)."""
    from huggingface_hub import HfApi

    repo_id = args.hub_model_id or Path(args.output_dir).resolve().name
    try:
        api = HfApi()
        repo_id = api.create_repo(repo_id, exist_ok=True).repo_id
        api.upload_folder(repo_id=repo_id, folder_path=args.output_dir, ignore_patterns=["checkpoints/*", ".*"])
    except Exception as error:  # network, authentication, offline mode: say what to do
        raise RuntimeError(
            f"Pushing to the Hub repository {repo_id!r} failed ({type(error).__name__}: {error}). The trained model is "
            f"saved in {args.output_dir}; log in with `hf auth login` and upload it with `hf upload {repo_id} {args.output_dir}`."
        ) from error
