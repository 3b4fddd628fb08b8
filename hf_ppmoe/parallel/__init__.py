"""Parallelism for our models, applied from outside to a built model (nothing in hf_ppmoe.moe / hf_ppmoe.modeling
imports torch.distributed).

    init_distributed()                      join the torchrun / accelerate job, with a timeout
    make_mesh(pp=2, tp=2)                   (dp, pp, tp) DeviceMesh, every sub-group with a timeout
    parallelize(model, mesh["tp"])          tensor parallelism + PPMoE expert parallelism over a TP group
    Pipeline(model, mesh["pp"], num_microbatches=4, schedule="1f1b", tp=mesh["tp"]).step(ids, labels, mask)

`hf_ppmoe.parallel.megatron` (imported on its own) is the Megatron-LM backend through Accelerate.

Transformers' own entry points use the same rules: `from_pretrained(path, distributed_config=DistributedConfig(
tp_size=N))` (PPMoE from the tensor-parallel plan) or `DistributedConfig(tp_size=N, ep_size=N,
ep_implementation="ppmoe")` (through Transformers' expert-parallel dispatch).
"""

from . import expert_parallel  # registers the "ppmoe" plan styles and expert-parallel implementation
from .comm import Collective, copy_to, count_collectives, reduce_from, scale_grad
from .expert_parallel import PPMoEExperts
from .mesh import init_distributed, make_mesh
from .pipeline import SCHEDULES, GPTMoEStage, Pipeline, Seq2SeqMoEStage, split_layers
from .tensor_parallel import parallelize

__all__ = [
    "SCHEDULES",
    "Collective",
    "GPTMoEStage",
    "PPMoEExperts",
    "Pipeline",
    "Seq2SeqMoEStage",
    "copy_to",
    "count_collectives",
    "init_distributed",
    "make_mesh",
    "parallelize",
    "reduce_from",
    "scale_grad",
    "split_layers",
]
