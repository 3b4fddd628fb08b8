"""Pipeline parallelism: stages cut from our own model classes, run by `torch.distributed.pipelining` schedules.

`Pipeline(model, pp_group, num_microbatches=M)` keeps this rank's stage of a built model (`GPTMoEStage`, or
`Seq2SeqMoEStage`, which cuts the encoder's layers then the decoder's and passes the encoder output along), and
`step(input_ids, labels, attention_mask)` runs one GPipe or 1F1B iteration: every stage's parameters get the gradient
a single device accumulates over the same microbatches, the LM loss a token mean over the whole batch plus the mean
of the microbatches' `hf_ppmoe.moe.losses.router_loss`. Router losses stay in their stage's graph; parameters that
several stages hold get the sum of their copies' gradients. With `tp=...` each stage is also split (`parallelize`).

docs/parallel.md draws the stages and the loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from ..modeling.stages import cut_stack, is_held
from ..modeling.loss import is_target, lm_targets, num_target_tokens
from ..moe.layer import MoELayer
from ..moe.losses import mean_over_layers, router_loss
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
    """Identity on `hidden`; in backward, also gives the router `loss` the gradient `scale` (its weight in the loss)."""

    @staticmethod
    def forward(ctx, hidden, loss, scale):
        ctx.scale, ctx.dtype = scale, loss.dtype
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full((), ctx.scale, dtype=ctx.dtype), None


def _head_tied(model) -> bool:
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def _contiguous(grad):
    return grad.contiguous()


class _Stage(nn.Module):
    """What the stages of both families share: the router losses of the stage's MoE layers, and received activations
    whose gradients go back over gloo (which sends only contiguous buffers)."""

    def __init__(self, model, is_first: bool, is_last: bool, num_microbatches: int, num_moe_layers: int):
        super().__init__()
        self.model, self.is_first, self.is_last = model, is_first, is_last
        self.num_moe_layers = max(1, num_moe_layers)  # of the whole model
        self.router_loss_grad_scale = 1 / num_microbatches
        self.router_losses: list[torch.Tensor] = []  # this step's (aux, z) of this stage, per microbatch (detached)

    def _with_router_loss(self, hidden, stacks):
        """`hidden`, carrying in backward the router loss of this stage's MoE layers. stacks: (stack output, number
        of this stage's MoE layers in that stack); a stack's aux/z losses average over those layers, the model's
        over all of its MoE layers."""
        config = self.model.config
        aux, z = mean_over_layers([(out.aux_loss, out.z_loss, n) for out, n in stacks], self.num_moe_layers)
        if aux is None:  # no MoE layers here, or forward only (no gradients: no router losses)
            return hidden
        self.router_losses.append(torch.stack([aux, z]).detach())
        return _RouterLossGrad.apply(hidden, router_loss(config, aux, z), self.router_loss_grad_scale)

    @staticmethod
    def _received(*tensors):
        for t in tensors:
            if t.requires_grad:
                t.register_hook(_contiguous)
        return tensors

    def shared_parameters(self) -> dict[str, nn.Parameter]:
        """Parameters other stages also hold, by a name every stage uses for them."""
        return {}

    def loss(self, logits, labels, num_items_in_batch):
        """The model's own LM loss (`loss_function`: causal for GPT-MoE, the labels as they are for Seq2Seq-MoE)."""
        return self.model.loss_function(logits, labels, self.model.config.vocab_size, num_items_in_batch=num_items_in_batch)


class GPTMoEStage(_Stage):
    """Layers `layers` of a `GPTMoEForCausalLM`, with the embeddings on the first stage and the final norm and head
    on the last. `model` is trimmed in place (`hf_ppmoe.modeling.stages.cut_stack`: the layers keep their index in
    the whole model) and kept as `self.model`; the stage runs its `model.model` forward.

    forward(x, attention_mask=None): x is input_ids [B, L] on the first stage, hidden states [B, L, H] on the others;
    returns hidden states, or the logits on the last stage."""

    def __init__(self, model, layers: range, is_first: bool, is_last: bool, num_microbatches: int):
        base, config = model.model, model.config
        tied = _head_tied(model)
        cut_stack(base, layers)
        if not is_last:
            model.lm_head = None
        model.init_parallel_plans()  # the plans now name only what this stage holds
        moe_total = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        super().__init__(model, is_first, is_last, num_microbatches, moe_total)
        self.tied = tied
        self.moe_here = sum(isinstance(layer.mlp, MoELayer) for layer in base.layers if is_held(layer))

    @staticmethod
    def num_layers(config) -> int:
        return config.num_hidden_layers

    def forward(self, x, attention_mask=None):
        if not self.is_first:
            self._received(x)
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        out = self.model.model(**inputs, attention_mask=attention_mask, use_cache=False)  # losses: with gradients
        hidden = self._with_router_loss(out.last_hidden_state, [(out, self.moe_here)])
        return self.model.lm_head(hidden) if self.is_last else hidden

    def shared_parameters(self):
        if self.is_first:
            return {"embeddings": self.model.model.embed_tokens.weight}
        return {"embeddings": self.model.lm_head.weight} if self.is_last and self.tied else {}

    def step_inputs(self, input_ids, labels, attention_mask, decoder_attention_mask):
        """(first stage's positional inputs, every stage's keyword inputs, the label tokens the loss counts)."""
        if decoder_attention_mask is not None:
            raise ValueError("decoder_attention_mask is for encoder-decoders; a GPT-MoE takes attention_mask only.")
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        return (input_ids,), kwargs, num_target_tokens(lm_targets(labels, causal=True))

    def example_io(self, batch: int, source_len: int, target_len: int):
        """Meta tensors shaped as this stage's inputs and outputs for microbatches of [batch, source_len]."""
        config, dtype = self.model.config, self.model.dtype
        hidden = torch.empty(batch, source_len, config.hidden_size, dtype=dtype, device="meta", requires_grad=True)
        inputs = torch.empty(batch, source_len, dtype=torch.long, device="meta") if self.is_first else hidden
        logits = torch.empty(batch, source_len, config.vocab_size, dtype=dtype, device="meta")
        return (inputs,), (logits if self.is_last else hidden,)


class Seq2SeqMoEStage(_Stage):
    """Layers `layers` of a `Seq2SeqMoEForConditionalGeneration`, counted encoder first: 0 .. E-1 are the encoder's,
    E .. E+D-1 the decoder's. A stage keeps the shared embeddings where a stack starts, a stack's relative position
    bias table where it has that stack's layers, a stack's final norm and output dropout where it ends
    (`hf_ppmoe.modeling.stages.cut_stack`), the head on the last stage; it runs the stacks' own forwards.

    Positional inputs and outputs, per microbatch (what the previous stage sent / what goes to the next):
        input_ids [B, S] (first stage)   encoder hidden [B, S, H] (inside the encoder)
        encoder output [B, S, H] (the decoder starts here)   (decoder hidden [B, L, H], encoder output) (inside the
        decoder)   logits [B, L, V] (last stage's output)
    Keyword inputs (every stage): attention_mask [B, S], decoder_input_ids, decoder_attention_mask and
    decoder_token_mask (label tokens: the tokens router losses count) [B, L]."""

    def __init__(self, model, layers: range, is_first: bool, is_last: bool, num_microbatches: int):
        base, config = model.model, model.config
        E, D = config.num_hidden_layers, config.num_decoder_layers
        tied = _head_tied(model)
        keep = {"encoder": [i for i in layers if i < E], "decoder": [i - E for i in layers if i >= E]}
        moe_here = {name: sum(getattr(base, name).layers[i].is_moe for i in keep[name]) for name in keep}
        for name in ("encoder", "decoder"):
            stack = getattr(base, name)
            if not keep[name]:
                setattr(base, name, None)
                continue
            cut_stack(stack, keep[name])
        if 0 not in keep["encoder"] and 0 not in keep["decoder"]:
            base.shared = None
        if not is_last:
            model.lm_head = None
        model.init_parallel_plans()
        moe_total = sum(map(config.is_encoder_moe_layer, range(E))) + sum(map(config.is_decoder_moe_layer, range(D)))
        super().__init__(model, is_first, is_last, num_microbatches, moe_total)
        self.tied, self.moe_here = tied, moe_here
        self.encoder_start, self.encoder_end = 0 in keep["encoder"], E - 1 in keep["encoder"]
        self.decoder_start = 0 in keep["decoder"]

    @staticmethod
    def num_layers(config) -> int:
        return config.num_hidden_layers + config.num_decoder_layers

    def forward(
        self, *inputs, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None, decoder_token_mask=None
    ):
        base, stacks = self.model.model, []
        if not self.encoder_start:
            inputs = self._received(*inputs)
        if base.encoder is not None:
            (x,) = inputs
            x = {"input_ids" if self.encoder_start else "inputs_embeds": x}
            out = base.encoder(**x, attention_mask=attention_mask, compute_router_losses=True)
            stacks.append((out, self.moe_here["encoder"]))
            if not self.encoder_end:
                return self._with_router_loss(out.last_hidden_state, stacks)
            hidden, encoder_output = None, out.last_hidden_state
        elif self.decoder_start:
            hidden, (encoder_output,) = None, inputs
        else:
            hidden, encoder_output = inputs
        if base.decoder is None:
            return self._with_router_loss(encoder_output, stacks)
        x = {"decoder_input_ids": decoder_input_ids} if self.decoder_start else {"decoder_inputs_embeds": hidden}
        out = base.decode(
            encoder_output,
            attention_mask,
            decoder_attention_mask=decoder_attention_mask,
            decoder_token_mask=decoder_token_mask,
            use_cache=False,
            compute_router_losses=True,
            **x,
        )
        stacks.append((out, self.moe_here["decoder"]))
        if not self.is_last:
            return self._with_router_loss(out.last_hidden_state, stacks), encoder_output
        return self.model.lm_logits(self._with_router_loss(out.last_hidden_state, stacks))

    def shared_parameters(self):
        base, shared = self.model.model, {}
        if base.shared is not None:
            shared["embeddings"] = base.shared.weight
        elif self.is_last and self.tied:
            shared["embeddings"] = self.model.lm_head.weight
        for name in ("encoder", "decoder"):
            if getattr(base, name) is not None:
                shared[f"{name}.relative_attention_bias"] = getattr(base, name).relative_attention_bias.weight
        return shared

    def step_inputs(self, input_ids, labels, attention_mask, decoder_attention_mask):
        kwargs = {"decoder_input_ids": self.model._shift_right(labels), "decoder_token_mask": is_target(labels)}
        for name, mask in (("attention_mask", attention_mask), ("decoder_attention_mask", decoder_attention_mask)):
            if mask is not None:
                kwargs[name] = mask
        return (input_ids,), kwargs, num_target_tokens(lm_targets(labels, causal=False))

    def example_io(self, batch: int, source_len: int, target_len: int):
        config, dtype, base = self.model.config, self.model.dtype, self.model.model

        def hidden(length):
            return torch.empty(batch, length, config.hidden_size, dtype=dtype, device="meta", requires_grad=True)

        if self.encoder_start:
            inputs = (torch.empty(batch, source_len, dtype=torch.long, device="meta"),)
        elif base.encoder is not None or self.decoder_start:
            inputs = (hidden(source_len),)
        else:
            inputs = (hidden(target_len), hidden(source_len))
        if self.is_last:
            outputs = (torch.empty(batch, target_len, config.vocab_size, dtype=dtype, device="meta"),)
        elif base.decoder is None:
            outputs = (hidden(source_len),)
        else:
            outputs = (hidden(target_len), hidden(source_len))
        return inputs, outputs


class Pipeline:
    """This rank's stage of `model` (a GPT-MoE or a Seq2Seq-MoE) and a pipeline schedule over the group `pp` (a
    `ProcessGroup` or 1-D `DeviceMesh`). See the module docstring.

    Args:
        layers: one `range` of layer indices per stage (an encoder-decoder counts the encoder's layers first);
            default `split_layers` (even).
        schedule: "1f1b" (default) or "gpipe".
        tp: optional tensor-parallel group / 1-D mesh: the stage is then split with `parallelize` (TP x PP).

    `module` is the stage (give its parameters to the optimizer), `layers[r]` the layers of stage r (indices in the
    whole model). The batch size must be a multiple of `num_microbatches`; a new batch shape sets the schedule up
    again (cheap, but keep shapes fixed where you can). After `step`, `losses` holds that step's parts of the loss
    on every rank: {"lm", "aux", "z", "num_target_tokens"} (LM token mean; router aux / z losses averaged over the
    model's MoE layers and the microbatches, before their coefficients; the batch's target tokens). `forward` runs a
    GPT-MoE forward only, `lm_loss` its LM loss (evaluation).
    """

    def __init__(self, model, pp, *, num_microbatches: int, schedule: str = "1f1b", layers=None, tp=None):
        if schedule not in SCHEDULES:
            raise ValueError(f"Unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}.")
        self.group = pp.get_group() if isinstance(pp, DeviceMesh) else pp
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        stage_class = Seq2SeqMoEStage if model.config.is_encoder_decoder else GPTMoEStage
        layers = layers or split_layers(stage_class.num_layers(model.config), self.size)
        if len(layers) != self.size:
            raise ValueError(f"`layers` gives {len(layers)} stages, but the pipeline group has {self.size} ranks.")
        self.layers = list(layers)
        self.module = stage_class(model, layers[self.rank], self.rank == 0, self.rank == self.size - 1, num_microbatches)
        if tp is not None:
            parallelize(model, tp)
        # which stages hold each shared parameter (the same dict, in the same order, on every rank)
        names = [None] * self.size
        dist.all_gather_object(names, sorted(self.module.shared_parameters()), group=self.group)
        self.holders = {key: [r for r in range(self.size) if key in names[r]] for key in sorted(set().union(*names))}
        self.device = next(model.parameters()).device
        self.num_microbatches, self.schedule_class = num_microbatches, SCHEDULES[schedule]
        self.schedule, self._shape, self.losses = None, None, {}

    def _set_up(self, shape) -> None:
        """Stage and schedule for batches of `shape` (inputs, labels), with the activation shapes given up front:
        torch's pipelining would otherwise infer them by running the first microbatch an extra time (which draws
        from the routers' random generators and records router losses that belong to no step)."""
        (batch, source_len), (_, target_len) = shape
        if batch % self.num_microbatches:
            raise ValueError(f"Batch size {batch} is not a multiple of num_microbatches={self.num_microbatches}.")
        inputs, outputs = self.module.example_io(batch // self.num_microbatches, source_len, target_len)
        stage = PipelineStage(
            self.module, self.rank, self.size, self.device, input_args=inputs, output_args=outputs, group=self.group
        )
        # every rank passes the loss: without one a schedule runs forward only
        self.schedule = self.schedule_class(stage, self.num_microbatches, loss_fn=self.module.loss, scale_grads=False)
        self._shape = shape

    def _sum_shared_gradients(self) -> None:
        """Every copy of a parameter that several stages hold gets the sum of the copies' gradients (exchanged
        between those stages, added in stage order), so the copies stay equal through optimizer steps."""
        mine = self.module.shared_parameters()
        for key, holders in self.holders.items():
            if len(holders) < 2 or self.rank not in holders:
                continue
            weight = mine[key]
            grad = weight.grad
            if isinstance(grad, DTensor):  # e.g. the embedding's comes out replicated, a tied head's split: align
                weight.grad = grad.redistribute(weight.device_mesh, weight.placements)
                grad = weight.grad.to_local()
            grads = {r: torch.empty_like(grad) for r in holders if r != self.rank}
            ops = [dist.P2POp(dist.isend, grad.contiguous(), group=self.group, group_peer=r) for r in grads]
            ops += [dist.P2POp(dist.irecv, buffer, group=self.group, group_peer=r) for r, buffer in grads.items()]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            grads[self.rank] = grad.clone()
            grad.copy_(sum(grads[r] for r in holders))

    def step(self, input_ids, labels, attention_mask=None, decoder_attention_mask=None) -> torch.Tensor:
        """One forward + backward over all microbatches (every rank passes the same whole batch; labels [B, L] are
        the targets, -100 ignored, and for an encoder-decoder also give the decoder inputs, shifted right).
        Gradients accumulate into the stage's parameters; returns the loss (see the module docstring) on every
        rank."""
        shape = (tuple(input_ids.shape), tuple(labels.shape))
        if shape != self._shape:
            self._set_up(shape)
        args, kwargs, num_tokens = self.module.step_inputs(input_ids, labels, attention_mask, decoder_attention_mask)
        losses = []
        self.module.router_losses.clear()
        self.schedule.step(
            *(args if self.module.is_first else ()),
            target=labels if self.module.is_last else None,
            losses=losses,
            return_outputs=False,
            loss_kwargs={"num_items_in_batch": num_tokens} if self.module.is_last else None,
            **kwargs,
        )
        self._sum_shared_gradients()
        parts = torch.zeros(3, device=self.device)  # lm, aux, z: each stage adds its own
        if losses:
            parts[0] += torch.stack(losses).sum().detach()
        if self.module.router_losses:
            parts[1:] += torch.stack(self.module.router_losses).mean(0)
        dist.all_reduce(parts, group=self.group)
        self.losses = dict(zip(("lm", "aux", "z"), parts.unbind()), num_target_tokens=num_tokens)
        return parts[0] + router_loss(self.module.model.config, parts[1], parts[2])

    @torch.no_grad()
    def forward(self, input_ids, attention_mask=None):
        """A GPT-MoE forward only (evaluation, no router losses): the stages run one after another on the whole
        batch (every rank passes it), each sending its hidden states to the next. Returns the logits on the last
        stage, None on the others."""
        if not isinstance(self.module, GPTMoEStage):
            raise NotImplementedError("Pipeline.forward runs GPT-MoE stages; an encoder-decoder's are not supported.")
        x = input_ids
        if not self.module.is_first:
            config = self.module.model.config
            x = torch.empty(*input_ids.shape, config.hidden_size, dtype=self.module.model.dtype, device=self.device)
            dist.recv(x, group=self.group, group_src=self.rank - 1)
        out = self.module(x, attention_mask=attention_mask)
        if self.module.is_last:
            return out
        dist.send(out.to(self.module.model.dtype).contiguous(), group=self.group, group_dst=self.rank + 1)
        return None

    @torch.no_grad()
    def lm_loss(self, input_ids, labels, attention_mask=None):
        """`forward`, then on the last stage (LM loss, number of target tokens) of `labels` [B, L] (-100 ignored), by
        the model's own loss function; None on the other stages."""
        logits = self.forward(input_ids, attention_mask=attention_mask)
        if logits is None:
            return None
        return self.module.loss(logits, labels, None), num_target_tokens(lm_targets(labels, causal=True))
