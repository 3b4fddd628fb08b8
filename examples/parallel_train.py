"""Train a small GPT-MoE on the built-in corpus with tensor + PPMoE expert parallelism and/or pipeline parallelism.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/parallel_train.py --tp 2              # TP + PPMoE EP
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/parallel_train.py --pp 2 --schedule gpipe
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 examples/parallel_train.py --pp 2 --tp 2      # TP x PP
    accelerate launch --multi_gpu --num_processes 2 examples/parallel_train.py --tp 2          # torchrun underneath

gloo on CPU, NCCL on GPUs, with the same commands (accelerate's --multi_gpu only selects its torchrun launcher).
Every rank builds the same model (same seed) and reads the same batches; `parallelize` / `Pipeline` keep each
rank's part. Rank 0 prints the loss, which equals the single-process model's on the same batches.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
from hf_ppmoe.parallel import Pipeline, exit_distributed, init_distributed, make_mesh, parallelize
from hf_ppmoe.training.data import builtin_corpus, pack, train_tokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (the experts are split over it)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--router-type", default="gshard")
    args = parser.parse_args()

    init_distributed()
    mesh = make_mesh(pp=args.pp, tp=args.tp)
    torch.manual_seed(0)
    texts = builtin_corpus()
    tokenizer = train_tokenizer(texts)
    blocks = pack(texts, tokenizer, args.block_size)
    config = GPTMoEConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=args.block_size, num_experts=8, num_experts_per_tok=2, router_type=args.router_type,
        capacity_factor=2.0, pad_token_id=tokenizer.pad_token_id,
    )
    model = GPTMoEForCausalLM(config).train()
    if args.pp > 1:
        pipeline = Pipeline(
            model, mesh["pp"], num_microbatches=args.microbatches, schedule=args.schedule,
            tp=mesh["tp"] if args.tp > 1 else None,
        )
        module = pipeline.module
    else:
        module = parallelize(model, mesh["tp"])
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3)
    rank = dist.get_rank()
    if rank == 0:
        print(f"{dist.get_world_size()} processes: tp={args.tp} pp={args.pp} ({args.schedule}); {len(blocks)} blocks")
    start = time.perf_counter()
    for step in range(args.steps):
        ids = blocks[torch.randint(len(blocks), (args.batch_size,))]
        if args.pp > 1:
            loss = pipeline.step(ids, ids)
        else:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - start:.1f}s")
    exit_distributed(0)  # destroys the process groups and ends before gloo's threads can abort the process


if __name__ == "__main__":
    main()
