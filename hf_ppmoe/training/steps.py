"""One training step and one evaluation, shared by `hf-ppmoe train` (train.py), `MoETrainer`'s loss monitor
(trainer.py: Trainer runs its own step, the monitor reads each forward's losses with `forward_losses`) and the
demo's loop (hf_ppmoe/demo/loop.py):

    forward_losses(output, labels, causal)       [lm, aux, z, target tokens] of one forward given labels
    forward_backward(model, batch, causal)       one micro-batch: forward, backward; its `forward_losses`
    token_losses(model, input_ids, labels, ...)  the evaluation: per target token cross-entropy, from the logits
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F

from ..modeling import GPTMoEForCausalLM
from ..modeling.loss import IGNORE_INDEX, lm_loss_of, lm_targets


def forward_losses(output, labels: torch.Tensor, causal: bool) -> torch.Tensor:
    """[lm, aux, z, target tokens] of one forward given `labels`, detached, on the device, in float32: the model's
    fields (a dense Transformers model has only its LM loss: aux and z are 0)."""
    lm, count = lm_loss_of(output, labels, causal)
    zero = torch.zeros((), device=lm.device)
    aux, z = (getattr(output, name, None) for name in ("aux_loss", "z_loss"))
    return torch.stack([lm.detach().float(), (aux if aux is not None else zero).detach().float(),
                        (z if z is not None else zero).detach().float(), count.float()])


def forward_backward(model, batch: dict[str, torch.Tensor], causal: bool,
                     backward: Callable[[torch.Tensor], None] | None = None,
                     autocast: Callable[[], AbstractContextManager] = nullcontext) -> torch.Tensor:
    """One micro-batch: the forward given the batch's labels (inside `autocast()`), then the backward of the model's
    loss (through `backward`, e.g. `accelerator.backward`; by default `loss.backward()`). Returns its
    `forward_losses`.

    A micro-batch whose labels hold no target (all -100, one-token sequences) has LM loss 0, router losses weighted 0
    and zero gradients (`hf_ppmoe.modeling.loss.model_loss`): it adds nothing; its target count says so."""
    with autocast():
        out = model(**batch)
    (backward or torch.Tensor.backward)(out.loss)
    return forward_losses(out, batch["labels"], causal)


@torch.no_grad()
def token_losses(model, input_ids: torch.Tensor, labels: torch.Tensor | None = None, causal: bool = True,
                 **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The evaluation of one batch: the cross-entropy of every target token [B, T'] in float32 from the model's
    logits (router losses excluded), and the target mask (`lm_targets`). A causal model predicts `labels` (default:
    `input_ids`) shifted by one and runs without routing statistics; an encoder-decoder reads `labels` (its decoder
    input is the labels shifted right) and `inputs` (the attention mask)."""
    labels = input_ids if labels is None else labels
    if causal:
        quiet = {"compute_router_losses": False} if isinstance(model, GPTMoEForCausalLM) else {}  # no statistics
        logits = model(input_ids, **inputs, **quiet).logits[:, :-1]
    else:
        logits = model(input_ids, labels=labels, **inputs).logits
    targets = lm_targets(labels, causal)
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return losses.view(targets.shape), targets != IGNORE_INDEX
