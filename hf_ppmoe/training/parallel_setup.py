"""How `python -m hf_ppmoe.training` splits the model over its processes (all of it from hf_ppmoe.parallel): which
processes read which data (`DataParallelGroup`), the split (`split_model`), the gradient norm over the split
(`clip_gradients`), the whole model gathered for saving (`gather_model`), and Accelerate's FSDP request mapped onto
these flags or refused (`accelerate_fsdp_request`).

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
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from .. import parallel
from ..parallel import Pipeline, batch_mesh, expert_mesh, fully_shard_model, make_mesh, parallelize
from ..utils.quiet import dropped


class DataParallelGroup:
    """The processes that read different data, as a process group with a `reduce` (it averages no gradients: that is
    Accelerate's DDP, or FSDP2 for a split model). All of Accelerate's processes (each holds the whole model), or with
    a split model the mesh's replicas and FSDP ranks (`batch_mesh`), each `pp_size * tp_size` consecutive processes
    seeing the same batches. `rank` / `size` number them; `experts` is the
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


def split_model(model, args, dp: DataParallelGroup, monitor=None):
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


def clip_gradients(model, max_norm: float, dp: DataParallelGroup, pipe: Pipeline | None = None) -> torch.Tensor:
    """Clip by the whole model's gradient norm; returns the norm before clipping. A split model's norm sums every
    shard's squares and, in a pipeline, every stage's, a parameter several stages hold counted by its first holder."""
    if dp.mesh is None:
        return dp.accelerator.clip_grad_norm_(model.parameters(), max_norm or math.inf)
    params, counted, group = list(model.parameters()), None, None
    if pipe is not None:
        shared = pipe.module.shared_parameters().items()
        repeated = {id(p) for key, p in shared if pipe.holders[key][0] != pipe.rank}
        counted, group = [p for p in params if id(p) not in repeated], pipe.group
    return parallel.clip_grad_norm_(params, max_norm or math.inf, norm_parameters=counted, group=group)


def gather_model(model, dp: DataParallelGroup, pipe: Pipeline | None = None):
    """The whole model on rank 0 (None elsewhere) from a split one: replica 0's state dict with every shard gathered
    (`full_tensor`, collectives of the groups that hold it), a pipeline's stages (whose parameters carry the whole
    model's names, `hf_ppmoe.modeling.stages`) collected on stage 0."""
    base = pipe.module.model if pipe is not None else model
    writer = dp.rank == 0 and dp.mesh["tp"].get_local_rank() == 0  # of its stage
    state = {}
    # torch's hint that the FSDP and TP all-gathers of a parameter cannot be fused concerns steps that repeat
    with dropped("torch.distributed.tensor._redistribute", "While redistributing from"):
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


# Accelerate's FSDP options (`accelerate launch --fsdp_*`, as the variables it sets) that we cannot honour: refused
# when given a value other than the one that matches what we do. Each: variable -> (accepted values, why, what to do).
_OFF = ("", "false", "0", "no", "off")
_FSDP_REFUSED = {
    "FSDP_OFFLOAD_PARAMS": (_OFF, "CPU offload of parameters (FSDP2's CPUOffloadPolicy) is not wired into "
                            "hf_ppmoe.training", "shard over more processes (--fsdp_size) instead"),
    "FSDP_ACTIVATION_CHECKPOINTING": (_OFF, "activation checkpointing is not available in hf_ppmoe.training",
                                      "use more processes or a smaller --per_device_train_batch_size"),
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": (_OFF, "activation offload is not available in hf_ppmoe.training",
                                              "drop it"),
    "FSDP_FORWARD_PREFETCH": (_OFF, "explicit forward prefetching is not set by hf_ppmoe.training (FSDP2 "
                              "prefetches the next layer's all-gather itself)", "drop it"),
    "FSDP_BACKWARD_PREFETCH": (("", "backward_pre"), "FSDP2 always prefetches before the backward (BACKWARD_PRE)",
                               "use BACKWARD_PRE or drop it"),
    "FSDP_AUTO_WRAP_POLICY": (("", "transformer_based_wrap"), "hf_ppmoe.training shards each decoder layer (and the "
                              "experts) as one FSDP2 unit, Accelerate's TRANSFORMER_BASED_WRAP", "use "
                              "TRANSFORMER_BASED_WRAP or drop it"),
    "FSDP_IGNORED_MODULES": (("",), "every module is sharded by hf_ppmoe.training", "drop it"),
}


# Accelerate's FSDP options that FSDP2 built this way serves by construction: named in the run's line, with why
_FSDP_BY_CONSTRUCTION = {
    "FSDP_USE_ORIG_PARAMS": "FSDP2 always trains the original parameters",
    "FSDP_SYNC_MODULE_STATES": "the model is built alike on every process (the first rank's weights broadcast)",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "every process loads the checkpoint itself",
    "FSDP_MIN_NUM_PARAMS": "each decoder layer is one FSDP group",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "each decoder layer is one FSDP group",
    "FSDP_STATE_DICT_TYPE": "checkpoints are sharded torch.distributed.checkpoint files, the final model is gathered",
    "FSDP_VERSION": "FSDP2 (fully_shard) is what hf_ppmoe.training shards with",
}


def accelerate_fsdp_request(args, world_size: int) -> str | None:
    """Map Accelerate's FSDP request (`accelerate launch --use_fsdp`, ACCELERATE_USE_FSDP=true) onto our sharding
    (`--fsdp_size`, `--fsdp_reshard_after_forward`), or refuse what cannot be mapped (ValueError: one line naming
    the option and what to do); returns the line that says what was done. The variable is then cleared: Accelerate's
    own FSDP wrapper never sees our model (parallel_setup shards it with FSDP2). Options about FSDP1 or about loading
    (use_orig_params, sync_module_states, cpu_ram_efficient_loading, min_num_params, state_dict_type, ...) are
    served by construction; the line names each one that was given and why (`_FSDP_BY_CONSTRUCTION`)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    for name, (accepted, why, fix) in _FSDP_REFUSED.items():
        value = os.environ.get(name, "").strip()
        if value.lower() not in accepted:
            flag = "--" + name.lower()
            raise ValueError(f"accelerate launch {flag} {value}: {why}; {fix}.")
    os.environ.pop("ACCELERATE_USE_FSDP")
    strategy = os.environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
    strategy = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
                "5": "HYBRID_SHARD_ZERO2"}.get(strategy, strategy)
    # FSDP2's form of the same request: --fsdp_reshard_after_forward false (or a strategy name)
    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").upper()
    if reshard in ("FALSE", "0", "SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2") or strategy in ("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2"):
        args.fsdp_reshard_after_forward = False
    elif reshard not in ("TRUE", "1", "FULL_SHARD", "HYBRID_SHARD", "NO_SHARD"):
        raise ValueError(f"accelerate launch --fsdp_reshard_after_forward {reshard.lower()}: use true or false.")
    kept = "" if args.fsdp_reshard_after_forward else (
        ", each layer's gathered parameters kept from its forward to its backward (reshard_after_forward=False)")
    given = [f"{name.lower().removeprefix('fsdp_')}={os.environ[name]} ({why})"
             for name, why in _FSDP_BY_CONSTRUCTION.items() if os.environ.get(name, "").strip()]
    kept += "; as given: " + "; ".join(given) if given else ""
    split = args.tp_size * args.pp_size
    if args.fsdp_size > 1:
        return f"Accelerate's FSDP request ({strategy}) is served by --fsdp_size {args.fsdp_size} (FSDP2){kept}."
    if strategy == "NO_SHARD":
        return f"Accelerate's FSDP request with NO_SHARD: plain data parallelism (nothing is sharded){kept}."
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        size = world_size // split
    elif strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) // split
    else:
        raise ValueError(
            f"Accelerate's FSDP sharding strategy {strategy} is not known to python -m hf_ppmoe.training: use "
            "FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, HYBRID_SHARD_ZERO2 or NO_SHARD, or pass --fsdp_size N yourself."
        )
    args.fsdp_size = max(size, 1)
    return (f"Accelerate's FSDP request ({strategy}) mapped onto --fsdp_size {args.fsdp_size}: parameters, gradients "
            f"and AdamW state sharded with FSDP2 over that many processes{kept}.")
