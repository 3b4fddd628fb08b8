"""Pipeline parallelism: stages cut from our own model classes, run by `torch.distributed.pipelining` schedules.

    rank 0 (stage 0)                        rank 1 (stage 1, last)
    embeddings, layers [0, L/2)  ──hidden──>  layers [L/2, L), norm, head ──> loss per microbatch
                                <──grad────

`Pipeline(model, pp_group, num_microbatches=M)` keeps this rank's part of a built model (every rank builds the whole
model with the same weights first) and `step(input_ids, labels, attention_mask)` runs one GPipe or 1F1B iteration:
the batch is cut into M microbatches along dim 0, and every stage's parameters end up with the gradient of

    loss = sum over microbatches of CE_sum(mb) / N  +  mean over microbatches of router_loss(mb)

where N counts the label tokens of the whole batch (so padding and ignore_index weigh as in a full-batch token mean;
with equal microbatches this is the mean of the microbatch losses) and router_loss is the model's
`router_aux_loss_coef * aux_loss + router_z_loss_coef * z_loss` of that microbatch. This is the gradient a single
device accumulates over the same microbatches (PPMoE Sec. 3.3.6); the returned loss is that value, on every rank.

Router losses of a stage's MoE layers are part of that stage's graph: their gradient is injected where the stage's
output gradient arrives (Megatron's aux-loss auto-scaler), so nothing but hidden states crosses stages.

With `tp=...` every stage is also split over its tensor-parallel group (`parallelize`): TP x PP on a (pp, tp) mesh.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from ..moe.layer import MoELayer
from .tensor_parallel import parallelize

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous, as even as possible: 10 layers on 4 stages -> [0, 3), [3, 6), [6, 8), [8, 10)."""
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} pipeline stages need at least as many layers; the model has {num_layers}.")
    size, extra = divmod(num_layers, num_stages)
    starts = [i * size + min(i, extra) for i in range(num_stages + 1)]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


class _RouterLossGrad(torch.autograd.Function):
    """Identity on `hidden`; in backward, also gives `router_loss` the gradient `scale` (its weight in the loss)."""

    @staticmethod
    def forward(ctx, hidden, router_loss, scale):
        ctx.scale, ctx.dtype = scale, router_loss.dtype
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full((), ctx.scale, dtype=ctx.dtype), None


class _NoPositions(nn.Module):
    """Stands in for learned position embeddings after the first stage (the input already carries them)."""

    def forward(self, position_ids):
        return 0.0


class GPTMoEStage(nn.Module):
    """Layers `layers` of a `GPTMoEForCausalLM`, with the embeddings on the first stage and the final norm and head
    on the last. `model` is trimmed in place and kept as `self.model`.

    forward(x, attention_mask=None): x is input_ids [B, L] on the first stage, hidden states [B, L, H] on the others;
    returns hidden states, or the logits on the last stage."""

    def __init__(self, model, layers: range, is_first: bool, is_last: bool, num_microbatches: int):
        super().__init__()
        base, config = model.model, model.config
        base.layers = nn.ModuleList(base.layers[i] for i in layers)
        if not is_first:
            base.embed_tokens = None
            base.dropout = nn.Identity()  # applied to the embeddings only
            if config.position_embedding_type == "learned":
                base.embed_positions = _NoPositions()
        if not is_last:
            base.norm, model.lm_head = nn.Identity(), None
        model.init_parallel_plans()  # the plans now name only what this stage holds
        self.model, self.is_first, self.is_last = model, is_first, is_last
        moe_here = sum(isinstance(layer.mlp, MoELayer) for layer in base.layers)
        moe_total = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        self.router_loss_share = moe_here / max(1, moe_total)
        self.router_loss_grad_scale = 1 / num_microbatches
        self.router_losses: list[torch.Tensor] = []  # this step's, per microbatch (detached)

    def forward(self, x, attention_mask=None):
        config = self.model.config
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        out = self.model.model(**inputs, attention_mask=attention_mask, use_cache=False, compute_router_losses=True)
        hidden = out.last_hidden_state
        if out.aux_loss is not None:
            # the model's router loss averages over all MoE layers; this stage holds `router_loss_share` of them
            router_loss = self.router_loss_share * (
                config.router_aux_loss_coef * out.aux_loss + config.router_z_loss_coef * out.z_loss
            )
            hidden = _RouterLossGrad.apply(hidden, router_loss, self.router_loss_grad_scale)
            self.router_losses.append(router_loss.detach())
        return self.model.lm_head(hidden) if self.is_last else hidden

    def example_io(self, batch: int, seq_len: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Meta tensors shaped as this stage's inputs and outputs for microbatches of [batch, seq_len]."""
        config, dtype = self.model.config, self.model.dtype
        hidden = torch.empty(batch, seq_len, config.hidden_size, dtype=dtype, device="meta", requires_grad=True)
        inputs = torch.empty(batch, seq_len, dtype=torch.long, device="meta") if self.is_first else hidden
        outputs = torch.empty(batch, seq_len, config.vocab_size, dtype=dtype, device="meta") if self.is_last else hidden
        return (inputs,), (outputs,)


class Pipeline:
    """This rank's stage of `model` and a pipeline schedule over the group `pp` (a `ProcessGroup` or 1-D
    `DeviceMesh`). See the module docstring.

    Args:
        layers: one `range` of layer indices per stage; default `split_layers` (even).
        schedule: "1f1b" (default) or "gpipe".
        tp: optional tensor-parallel group / 1-D mesh: the stage is then split with `parallelize` (TP x PP).

    `module` is the stage (give its parameters to the optimizer). The batch size must be a multiple of
    `num_microbatches`; a new batch shape sets the schedule up again (cheap, but keep shapes fixed where you can).
    """

    def __init__(self, model, pp, *, num_microbatches: int, schedule: str = "1f1b", layers=None, tp=None):
        if schedule not in SCHEDULES:
            raise ValueError(f"Unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}.")
        self.group = pp.get_group() if isinstance(pp, DeviceMesh) else pp
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        layers = layers or split_layers(model.config.num_hidden_layers, self.size)
        if len(layers) != self.size:
            raise ValueError(f"`layers` gives {len(layers)} stages, but the pipeline group has {self.size} ranks.")
        head = model.get_output_embeddings()
        # a head tied to the input embeddings ends up on the last stage, the embeddings on the first
        self.tied = self.size > 1 and head is not None and head.weight is model.get_input_embeddings().weight
        self.module = GPTMoEStage(model, layers[self.rank], self.rank == 0, self.rank == self.size - 1, num_microbatches)
        if tp is not None:
            parallelize(model, tp)
        self.device = next(model.parameters()).device
        self.num_microbatches, self.schedule_class = num_microbatches, SCHEDULES[schedule]
        self.schedule, self._shape = None, None

    def _set_up(self, shape) -> None:
        """Stage and schedule for batches of `shape`, with the activation shapes given up front: torch's
        pipelining would otherwise infer them by running the first microbatch an extra time (which draws from
        the routers' random generators and records router losses that belong to no step)."""
        batch, seq_len = shape
        if batch % self.num_microbatches:
            raise ValueError(f"Batch size {batch} is not a multiple of num_microbatches={self.num_microbatches}.")
        inputs, outputs = self.module.example_io(batch // self.num_microbatches, seq_len)
        stage = PipelineStage(
            self.module, self.rank, self.size, self.device, input_args=inputs, output_args=outputs, group=self.group
        )
        # every rank passes the loss: without one a schedule runs forward only
        self.schedule = self.schedule_class(stage, self.num_microbatches, loss_fn=self._lm_loss, scale_grads=False)
        self._shape = shape

    def _lm_loss(self, logits, labels, num_items_in_batch):
        return self.module.model.loss_function(
            logits, labels, self.module.model.config.vocab_size, num_items_in_batch=num_items_in_batch
        )

    def _sum_tied_gradients(self) -> None:
        """The first stage's embeddings and the last stage's head are one tied weight: both copies get the sum of
        their gradients (exchanged between the two stages), so they stay equal through optimizer steps."""
        if not self.tied or not (self.module.is_first or self.module.is_last):
            return
        model = self.module.model
        weight = model.model.embed_tokens.weight if self.module.is_first else model.lm_head.weight
        grad = weight.grad
        if isinstance(grad, DTensor):  # the embedding's gradient comes out replicated, the head's split: align them
            weight.grad = grad.redistribute(weight.device_mesh, weight.placements)
            grad = weight.grad.to_local()
        other = torch.empty_like(grad)
        peer = self.size - 1 if self.module.is_first else 0
        ops = [
            dist.P2POp(dist.isend, grad.contiguous(), group=self.group, group_peer=peer),
            dist.P2POp(dist.irecv, other, group=self.group, group_peer=peer),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        grad += other

    def step(self, input_ids, labels, attention_mask=None) -> torch.Tensor:
        """One forward + backward over all microbatches (every rank passes the same whole batch). Gradients
        accumulate into the stage's parameters; returns the loss (see the module docstring) on every rank."""
        if tuple(input_ids.shape) != self._shape:
            self._set_up(tuple(input_ids.shape))
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        num_tokens = (labels[..., 1:] != -100).sum()  # the causal LM loss predicts token t+1 at position t
        losses = []
        self.module.router_losses.clear()
        self.schedule.step(
            *([input_ids] if self.module.is_first else []),
            target=labels if self.module.is_last else None,
            losses=losses,
            return_outputs=False,
            loss_kwargs={"num_items_in_batch": num_tokens} if self.module.is_last else None,
            **kwargs,
        )
        self._sum_tied_gradients()
        total = torch.zeros((), device=self.device)
        if losses:
            total = total + torch.stack(losses).sum().detach()
        if self.module.router_losses:
            total = total + torch.stack(self.module.router_losses).mean()
        dist.all_reduce(total, group=self.group)
        return total
