"""Accelerate's Megatron-LM backend end to end, as a user runs it: GPT-MoE with TP = EP = 2 from a converted
checkpoint, a few training steps, a Megatron-LM checkpoint at the end.

    torchrun --nproc_per_node 2 megatron_accelerate_train.py WORK_DIR

WORK_DIR holds hf/ (a GPTMoEForCausalLM), megatron/ (its conversion) and batches.pt; writes trained/ and
losses.json. Needs 2 CUDA GPUs and Megatron-LM's source tree on PYTHONPATH (see test_megatron_accelerate.py).
"""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import MegatronLMDummyScheduler, MegatronLMPlugin
from torch.utils.data import DataLoader

from hf_ppmoe import GPTMoEForCausalLM
from hf_ppmoe.megatron.plugin import GPTMoETrainStep, model_provider


def main(work: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # compare with the float32 reference
    model = GPTMoEForCausalLM.from_pretrained(f"{work}/hf")  # Accelerate reads only its config
    config = model.config
    plugin = MegatronLMPlugin(
        tp_degree=2,
        pp_degree=1,
        context_parallel_size=1,
        num_micro_batches=1,
        custom_model_provider_function=model_provider(config),
        custom_train_step_class=GPTMoETrainStep,
        custom_train_step_kwargs={"config": config},
        other_megatron_args={"ckpt_format": "torch"},
    )
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    batches = torch.load(f"{work}/batches.pt")
    loader = DataLoader([{"input_ids": row} for batch in batches for row in batch], batch_size=batches[0].shape[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = MegatronLMDummyScheduler(optimizer=optimizer, total_num_steps=len(batches), warmup_num_steps=0)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.load_state(f"{work}/megatron")
    losses = []
    model.train()
    for batch in loader:
        loss = model(**batch)  # Megatron's train step: forward, backward, optimizer step
        losses.append(float(loss))
    accelerator.save_state(f"{work}/trained")
    if accelerator.is_main_process:
        with open(f"{work}/losses.json", "w") as f:
            json.dump(losses, f)
    accelerator.end_training()  # destroys the process group before interpreter exit


if __name__ == "__main__":
    main(sys.argv[1])
