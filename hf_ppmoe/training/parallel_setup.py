"""How `python -m hf_ppmoe.training` splits the model over its processes (all of it from hf_ppmoe.parallel): which
processes read which data (`DataParallel`), the split (`split_model`), the gradient norm over the split
(`clip_grad_norm_`) and the whole model gathered for saving (`gather_model`).

WORLD_SIZE = replicas x fsdp_size x pp_size x tp_size, on a (dp, fsdp, pp, tp) mesh (tp innermost):

    no flag            Accelerate's DDP: every process holds the whole model
    --tp_size T        attention heads, dense FFNs and (PPMoE) the experts split over T consecutive processes
    --pp_size P        the layers cut into P pipeline stages
    --fsdp_size F      F processes shard what each of them would hold (parameters, gradients, AdamW state) with
                       FSDP2; the remaining replicas hold copies of that (HSDP: gradients reduce-scattered within F,
                       all-reduced across replicas)
    --ep_size E > T    every MoE layer's experts split over E = k x T processes (k tensor-parallel groups of
                       different batches, all-to-all) instead of over the tensor-parallel group

Every data-parallel process of a split model (a replica or an FSDP rank) is an FSDP2 rank: with F = 1 the replicas
are HSDP with shard groups of one (gradients averaged, nothing sharded), so one engine averages the gradients of
every layout.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from .. import parallel
from ..parallel import Pipeline, batch_mesh, expert_mesh, fully_shard_model, make_mesh, parallelize


class DataParallel:
    """The processes that read different data: all of Accelerate's (each holds the whole model; Accelerate's DDP
    averages the gradients), or with a split model the mesh's replicas and FSDP ranks (`batch_mesh`), each
    `pp_size * tp_size` consecutive processes seeing the same batches. `rank` / `size` number them; `experts` is the
    `expert_mesh` when `ep_size` > `tp_size`."""

    def __init__(self, accelerator: Accelerator, tp_size: int, pp_size: int = 1, fsdp_size: int = 1, ep_size=None):
        self.accelerator, self.mesh, self.experts = accelerator, None, None
        self.rank, self.size = accelerator.process_index, accelerator.num_processes
        split = tp_size * pp_size * fsdp_size
        if split > 1:
            if self.size % split:
                named = (("fsdp_size", fsdp_size), ("pp_size", pp_size), ("tp_size", tp_size))
                sizes = " with ".join(f"--{n} {v}" for n, v in named if v > 1)
                raise ValueError(
                    f"{sizes} needs a multiple of {split} processes; this job has {self.size}. Start it "
                    f"with `torchrun --nproc-per-node {split}` (or a multiple, for data parallelism on top)."
                )
            self.mesh = make_mesh(dp=self.size // split, fsdp=fsdp_size, pp=pp_size, tp=tp_size)
            self.batch = batch_mesh(self.mesh)
            self.rank, self.size = self.batch.get_local_rank(), self.batch.size()
            if ep_size and ep_size > tp_size:
                self.experts = expert_mesh(self.mesh, ep_size)

    @property
    def sharded(self) -> bool:
        """Whether the model's forward communicates across data-parallel processes (FSDP's all-gathers, the experts'
        all-to-all), so that every one of them must run every forward."""
        return self.mesh is not None and self.size > 1

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        """Sum or mean over the data-parallel processes (the processes of one tensor-parallel group hold the same
        value; those of one pipeline, their own stage's)."""
        if self.mesh is None:
            return self.accelerator.reduce(tensor, reduction=reduction)
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=self.batch.get_group())
        return tensor / self.size if reduction == "mean" else tensor


def split_model(model, args, dp: DataParallel, monitor=None):
    """Pipeline stage, tensor / expert parallelism, then FSDP2, in that order (every process built the same weights:
    same seed or checkpoint). `args` gives tp_size, pp_size and (the pipeline's microbatches)
    gradient_accumulation_steps; a `RouterMonitor` keeps only the stage's layers. Returns (the module to train, the
    `Pipeline` or None)."""
    if dp.mesh is None:
        return model, None
    pipe, stage_model = None, model
    if args.pp_size > 1:
        micro = args.gradient_accumulation_steps
        schedule = "1f1b" if micro >= args.pp_size else "gpipe"
        pipe = Pipeline(model, dp.mesh["pp"], num_microbatches=micro, schedule=schedule)
        model, stage_model = pipe.module, pipe.module.model
        if monitor is not None:
            monitor.keep_only(model)
    if args.tp_size > 1 or dp.experts is not None:
        parallelize(stage_model, dp.mesh["tp"], ep=dp.experts.ep if dp.experts else None)
    if dp.size > 1:
        fully_shard_model(model, dp.mesh, dp.experts, reshard_after_forward=args.fsdp_reshard_after_forward)
    return model, pipe


def clip_grad_norm_(model, max_norm: float, dp: DataParallel, pipe: Pipeline | None = None) -> torch.Tensor:
    """Clip by the whole model's gradient norm; returns the norm before clipping. A split model's norm sums every
    shard's squares and, in a pipeline, every stage's, a parameter several stages hold counted by its first holder."""
    if dp.mesh is None:
        return dp.accelerator.clip_grad_norm_(model.parameters(), max_norm or math.inf)
    params, counted, group = list(model.parameters()), None, None
    if pipe is not None:
        shared = pipe.module.shared_parameters().items()
        repeated = {id(p) for key, p in shared if pipe.holders[key][0] != pipe.rank}
        counted, group = [p for p in params if id(p) not in repeated], pipe.group
    return parallel.clip_grad_norm_(params, max_norm, norm_parameters=counted, group=group)


def gather_model(model, dp: DataParallel, pipe: Pipeline | None = None):
    """The whole model on rank 0 (None elsewhere) from a split one: replica 0's state dict with every shard gathered
    (`full_tensor`, collectives of the groups that hold it), a pipeline's stages (whose parameters carry the whole
    model's names, `hf_ppmoe.modeling.stages`) collected on stage 0."""
    base = pipe.module.model if pipe is not None else model
    writer = dp.rank == 0 and dp.mesh["tp"].get_local_rank() == 0  # of its stage
    state = {}
    for name, tensor in base.state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if writer:
            state[name] = tensor.detach().cpu()
    if not writer:
        return None
    if pipe is not None:
        stages = [None] * pipe.size if pipe.rank == 0 else None
        dist.gather_object(state, stages, group=pipe.group, group_dst=0)
        if pipe.rank != 0:
            return None
        state = {name: tensor for stage in stages for name, tensor in stage.items()}
    config = copy.copy(base.config)
    config.distributed_config = None  # set by tensor parallelism: save_pretrained would wait for the other ranks
    whole = (AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM).from_config(config)
    whole.load_state_dict(state)
    return whole
