"""Transformers' `Trainer` on a GPT-MoE or Seq2Seq-MoE sharded at load time by Transformers' `DistributedConfig`,
checked against one process.

    # CPU (gloo) or GPUs: FSDP2 (ZeRO-3-style sharding), and expert parallelism over the FSDP ranks (all-to-all)
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/trainer_distributed.py --fsdp 2
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/trainer_distributed.py --fsdp 2 --ep 2 --ep-impl all_to_all
    # GPUs only: Accelerate takes the tensor-parallel `ParallelismConfig` the Trainer builds for `tp_size > 1` only on
    # GPUs ("ParallelismConfig is only compatible DistributedType.FSDP (version 2) or DistributedType.Multi{Device}
    # ..., but got DistributedType.MULTI_CPU" on CPU)
    torchrun --nproc-per-node 2 examples/trainer_distributed.py --tp 2                        # TP + PPMoE experts
    torchrun --nproc-per-node 2 examples/trainer_distributed.py --tp 2 --ep 2 --ep-impl ppmoe
    torchrun --nproc-per-node 4 examples/trainer_distributed.py --tp 2 --fsdp 2               # TP x FSDP
    torchrun --nproc-per-node 4 examples/trainer_distributed.py --tp 2 --fsdp 2 --ep 2 --ep-impl ppmoe

Rank 0 saves a small random model; every rank loads it with `from_pretrained(path, distributed_config=...)` and a
`Trainer` trains it on fixed rows in order. Every rank also trains the same model alone (the reference): the
Trainer's gradient accumulation of `model(...).loss` over the same micro-batches (the data-parallel ranks' batches
of each step, in rank order), global-norm clipping at 1.0 and AdamW. The script prints the largest differences of
the per-step losses and of the parameters after training; with --check it exits with status 1 above the tolerance.

Router losses: given the label tokens of the whole step (`num_items_in_batch`, which the Trainer passes and the
reference passes too), the model weighs each micro-batch's router losses by its share of them, as it divides the LM
loss (docs/training.md, Transformers' Trainer).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import DistributedConfig, Trainer, TrainingArguments

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM, Seq2SeqMoEConfig, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.parallel import exit_distributed, init_distributed

FAMILIES = {"gpt": GPTMoEForCausalLM, "seq2seq": Seq2SeqMoEForConditionalGeneration}
SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1, router_z_loss_coef=0.01, pad_token_id=0)


def build(family: str, seed: int = 0):
    """A small random model: top-2 dropless routing with losses (deterministic, so every layout routes alike)."""
    torch.manual_seed(seed)
    if family == "gpt":
        return GPTMoEForCausalLM(GPTMoEConfig(**SIZES, max_position_embeddings=64, num_key_value_heads=2))
    config = Seq2SeqMoEConfig(**SIZES, num_decoder_layers=2, decoder_start_token_id=0, eos_token_id=1)
    return Seq2SeqMoEForConditionalGeneration(config)


def make_rows(family: str, count: int, length: int = 8, seed: int = 1) -> list[dict]:
    """Fixed training rows (the Trainer reads them in order): a causal LM learns its input, an encoder-decoder a
    shorter target."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (count, length), generator=g)
    if family == "gpt":
        return [{"input_ids": row, "labels": row} for row in ids]
    targets = torch.randint(3, 97, (count, length // 2), generator=g)
    return [{"input_ids": row, "labels": target} for row, target in zip(ids, targets)]


def label_tokens(family: str, labels: torch.Tensor) -> torch.Tensor:
    """The tokens the Trainer counts for `num_items_in_batch`: a causal LM predicts token t+1 at position t."""
    return (labels[..., 1:] if family == "gpt" else labels).ne(-100).sum()


def train_with_trainer(path, family, distributed_config, rows, *, steps, batch_size, accumulation, output_dir):
    """(per-step losses the Trainer logged, the trained model) for the model at `path` split by
    `distributed_config`."""
    model = FAMILIES[family].from_pretrained(path, distributed_config=distributed_config)
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
        max_steps=steps, learning_rate=1e-2, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], model


def train_reference(path, family, rows, *, steps, micro_batch, micro_batches, device):
    """One process: per step, `micro_batches` consecutive micro-batches of `micro_batch` rows, each backward of
    `model(..., num_items_in_batch=label tokens of the step).loss` (what the Trainer does on every rank), then
    clipping and AdamW. Returns (per-step sums of the micro-batch losses, as the Trainer logs them; the model)."""
    model = FAMILIES[family].from_pretrained(path).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses, start = [], 0
    for _ in range(steps):
        chunks = []
        for _ in range(micro_batches):
            part = rows[start : start + micro_batch]
            chunks.append({key: torch.stack([row[key] for row in part]).to(device) for key in part[0]})
            start += micro_batch
        num_items = sum(label_tokens(family, chunk["labels"]) for chunk in chunks)
        total = 0.0
        for chunk in chunks:
            loss = model(**chunk, num_items_in_batch=num_items).loss
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, model


def max_param_diff(model, reference) -> float:
    """Largest |split - reference| over the parameters (split ones gathered: a collective, every rank calls it)."""
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        worst = max(worst, (full.detach().to(ref[name].device) - ref[name]).abs().max().item())
    return worst


def compare(family, distributed_config, *, steps=2, batch_size=2, accumulation=1, output_dir=None) -> dict:
    """Trainer on `distributed_config` vs one process, on this job's ranks: {"losses", "ref_losses", "loss_diff",
    "param_diff"}."""
    data_parallel = dist.get_world_size() // distributed_config.tp_size
    rows = make_rows(family, steps * batch_size * accumulation * data_parallel)
    if output_dir is None:  # one folder for all ranks
        shared = [tempfile.mkdtemp(prefix="trainer_distributed_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        output_dir = shared[0]
    path = os.path.join(output_dir, f"initial_{family}")
    if dist.get_rank() == 0:
        build(family).save_pretrained(path)
    dist.barrier()
    losses, model = train_with_trainer(
        path, family, distributed_config, rows, steps=steps, batch_size=batch_size, accumulation=accumulation,
        output_dir=output_dir,
    )
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    ref_losses, reference = train_reference(
        path, family, rows, steps=steps, micro_batch=batch_size, micro_batches=accumulation * data_parallel,
        device=device,
    )
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "param_diff": max_param_diff(model, reference),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=FAMILIES, default="gpt")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (our experts are split over it)")
    parser.add_argument("--fsdp", type=int, default=1, help="FSDP2 (sharded data-parallel) size")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--ep-impl", default="ppmoe", help="ppmoe | all_reduce (ep = tp) | all_to_all | auto")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2, help="rows per device and micro-batch")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--check", action="store_true", help="exit with 1 if the Trainer differs from one process")
    args = parser.parse_args()

    init_distributed()
    extra = {"ep_size": args.ep, "ep_implementation": args.ep_impl} if args.ep > 1 else {}
    config = DistributedConfig(tp_size=args.tp, fsdp_size=args.fsdp, **extra)
    result = compare(args.family, config, steps=args.steps, batch_size=args.batch_size, accumulation=args.accumulation)
    if dist.get_rank() == 0:
        layout = f"tp={args.tp} fsdp={args.fsdp} ep={args.ep}" + (f" ({args.ep_impl})" if args.ep > 1 else "")
        print(f"{dist.get_world_size()} processes, {layout}: Trainer losses {result['losses']}")
        print(f"one process: {result['ref_losses']}")
        print(f"largest difference: loss {result['loss_diff']:.2e}, parameters {result['param_diff']:.2e}")
    ok = result["loss_diff"] < 1e-5 and result["param_diff"] < 5e-5
    exit_distributed(0 if ok or not args.check else 1)  # ends before gloo's threads can abort the process


if __name__ == "__main__":
    main()
