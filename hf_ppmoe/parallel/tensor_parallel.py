"""`parallelize`: tensor parallelism + PPMoE expert parallelism on a built model, over any tensor-parallel group.

It applies the model's own Transformers plan (`config.base_model_tp_plan`, `_tp_plan`), the same rules
`from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))` applies, but on a group you choose: a
sub-mesh of a (pp, tp) mesh for TP x PP, a trimmed pipeline stage, or a model you built or changed yourself:

    attention           q/k/v colwise, o rowwise (heads split; one all-reduce of [T, H] each way)
    dense FFN, shared   gate/up colwise, down rowwise
    MoE layer           PPMoE: whole experts split over the group, replicated router (expert_parallel.py)
    embeddings / head   vocabulary split (embedding_rowwise / colwise_gather_output)

Norms, routers and learned position embeddings stay whole (replicated) on every rank.

Transformers' colwise rule turns its input into a replicated DTensor itself, so q, k and v (or gate and up) each
all-reduce their input gradient: three (two) all-reduces of [T, H] in backward where Megatron has one. The
"replicated_input" rule on the attention module (and "ppmoe_ffn" on the FFN slot, expert_parallel.py) makes the
module's input that DTensor once, so autograd sums the partial gradients first and one all-reduce remains.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from transformers import DistributedConfig
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
from transformers.distributed.tensor_parallel import TensorParallelLayer, apply_tensor_parallelism


class ReplicatedInputParallel(TensorParallelLayer):
    """Plan style "replicated_input": the module's first argument enters the tensor-parallel region once, as a
    replicated DTensor (in training; inference keeps Transformers' local fast paths)."""

    def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
        if not args or isinstance(args[0], DTensor) or not (torch.is_grad_enabled() and args[0].requires_grad):
            return args, kwargs
        return (DTensor.from_local(args[0], mesh, [Replicate()], run_check=False), *args[1:]), kwargs


ALL_PARALLEL_STYLES.register("replicated_input", ReplicatedInputParallel())


def _mesh(group_or_mesh, model) -> DeviceMesh:
    if isinstance(group_or_mesh, DeviceMesh):
        if group_or_mesh.ndim != 1:
            raise ValueError(f"Pass a 1-D tensor-parallel mesh (e.g. mesh['tp']), got {group_or_mesh}.")
        return group_or_mesh
    device_type = next(model.parameters()).device.type
    return DeviceMesh.from_group(group_or_mesh, device_type)


def _check_expert_split(config, tp_size: int) -> None:
    """ValueError naming the sizes when an MoE layer's experts cannot be split evenly over `tp_size` ranks."""
    if config.num_experts % tp_size:
        raise ValueError(
            f"num_experts={config.num_experts} cannot be split evenly over a tensor-parallel group of {tp_size} "
            f"ranks: PPMoE gives every rank num_experts / {tp_size} whole experts. Use a group size that divides "
            f"{config.num_experts}."
        )


def parallelize(model, tp):
    """Split `model` (a GPT-MoE, built or loaded: any model whose config carries our plans) in place over the
    tensor-parallel group `tp` (a `ProcessGroup` or a 1-D `DeviceMesh`) and return it.

    Every rank must pass a model with the same weights (same seed, or the same checkpoint): each keeps its own slice,
    nothing is broadcast. Parameters that are split become DTensors (`p.full_tensor()` / `p.grad.full_tensor()`
    gather them); the rest stay plain tensors with identical values and gradients on every rank. Gradients equal the
    single-device model's. `save_pretrained` afterwards (on every rank) writes the whole model from rank 0.
    """
    mesh = _mesh(tp, model)
    size = mesh.size()
    _check_expert_split(model.config, size)
    if size == 1:
        return model
    config = DistributedConfig(tp_size=size)
    tp_plan, _, _ = model._resolve_parallel_plans(config)
    with model.tied_head_kept():
        apply_tensor_parallelism(model, mesh, tp_plan)
    # what `from_pretrained(distributed_config=...)` records, so `save_pretrained` gathers the split weights
    model.config.distributed_config, model._device_mesh, model._tp_size = config, mesh, size
    return model
