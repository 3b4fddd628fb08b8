"""A check that all processes of a run start alike, made once before training.

With --tp_size / --pp_size every process builds the whole model and keeps its part: the processes of one
tensor-parallel group must build the same weights, or the group computes with a model that belongs to no process
(nothing fails; the loss is simply wrong). The data-parallel replicas of such a mesh must also start equal, since
nothing broadcasts their weights, and every process reads its batch rows from (seed, step): a process started with
other arguments (another --seed) trains on rows the others do not expect.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def check_processes_agree(args, model: torch.nn.Module) -> None:
    """Raise ValueError on every process if the processes of this run were started with different arguments or
    built different initial weights (compared by a float64 sum per parameter; one all_gather_object)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    names = [name for name, _ in model.named_parameters()]
    with torch.no_grad():
        sums = torch.stack([p.detach().double().sum() for p in model.parameters()]).cpu().tolist()
    mine = {"arguments": json.loads(args.to_json()), "weights": sums}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first = everyone[0]
    for rank, theirs in enumerate(everyone[1:], 1):
        differing = [n for n in first["arguments"] if first["arguments"][n] != theirs["arguments"].get(n)]
        if differing:
            shown = ", ".join(f"{n}={first['arguments'][n]!r} on rank 0, {theirs['arguments'].get(n)!r} on rank {rank}" for n in differing)
            raise ValueError(
                f"The processes of this run were started with different arguments ({shown}). Every process must get "
                "the same arguments: the processes of a tensor-parallel group build their weights from --seed, and "
                "every process reads its rows of the data from it."
            )
        weights = [n for n, a, b in zip(names, first["weights"], theirs["weights"]) if a != b]
        if weights:
            raise ValueError(
                f"Rank {rank} built other initial weights than rank 0 (first in {weights[0]}; {len(weights)} tensors "
                "differ), although the arguments agree. The processes of a tensor-parallel group must hold the same "
                "model: make initialisation deterministic for the seed (the same --seed, the same checkpoint)."
            )
