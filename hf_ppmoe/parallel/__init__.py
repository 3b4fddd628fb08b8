"""Parallelism for our models, applied from outside to a built model (nothing in hf_ppmoe.moe / hf_ppmoe.modeling
imports torch.distributed).

    init_distributed()                      join the torchrun / accelerate job, with a timeout
    exit_distributed(code)                  end the process without gloo's threads aborting it (mesh.py says why)
    make_mesh(fsdp=2, pp=2, tp=2)           (dp, fsdp, pp, tp) DeviceMesh, every sub-group with a timeout
    parallelize(model, mesh["tp"])          tensor parallelism + PPMoE expert parallelism over a TP group
    Pipeline(model, mesh["pp"], num_microbatches=4, schedule="1f1b", tp=mesh["tp"]).step(ids, labels, mask)
    fully_shard_model(model, mesh)          FSDP2 over mesh's fsdp ranks (HSDP with dp replicas), after the above
    parallelize(model, mesh["tp"], ep=expert_mesh(mesh, 4).ep)   experts over 4 ranks (> tp): all-to-all

`print(model)` afterwards shows the modules each style changed (`TensorParallelMoELayer`, `ExpertParallelExperts`,
`TensorParallelLinear`, ...: modules.py). `hf_ppmoe.megatron` is the Megatron-LM
backend through Accelerate.

Transformers' own entry points use the same rules: `from_pretrained(path, distributed_config=DistributedConfig(
tp_size=N))` (PPMoE from the tensor-parallel plan) or `DistributedConfig(tp_size=N, ep_size=N,
ep_implementation="ppmoe")` (through Transformers' expert-parallel dispatch).
"""

from . import expert_parallel  # registers the "ppmoe" plan styles and expert-parallel implementation
from .comm import Collective, copy_to, count_collectives, reduce_from, sum_over
from .fsdp import clip_grad_norm_, fully_shard_model, state_bytes
from .expert_parallel import AllToAllWithDrops, PPMoEExperts
from .mesh import ExpertMesh, batch_mesh, exit_distributed, expert_mesh, init_distributed, make_mesh
from .pipeline import SCHEDULES, GPTMoEStage, Pipeline, Seq2SeqMoEStage, split_layers
from .tensor_parallel import parallelize

__all__ = [
    "SCHEDULES",
    "AllToAllWithDrops",
    "Collective",
    "ExpertMesh",
    "GPTMoEStage",
    "PPMoEExperts",
    "Pipeline",
    "Seq2SeqMoEStage",
    "batch_mesh",
    "clip_grad_norm_",
    "copy_to",
    "count_collectives",
    "exit_distributed",
    "expert_mesh",
    "fully_shard_model",
    "init_distributed",
    "make_mesh",
    "parallelize",
    "reduce_from",
    "split_layers",
    "state_bytes",
    "sum_over",
]
