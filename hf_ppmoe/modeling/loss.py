"""The loss of both model families, computed forward: which labels are targets (`lm_targets`, the one place that
says it), and a model's `loss` with its parts (`model_loss` -> `ModelLoss`: the combined loss, the language-model
loss and the number of target tokens, which the outputs carry so that no consumer inverts the formula).

The router term itself is `hf_ppmoe.moe.losses.router_loss`.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from ..moe.losses import losses_wanted, router_loss

IGNORE_INDEX = -100  # a label that is no target (Transformers' and PyTorch's cross-entropy default)


def lm_targets(labels: torch.Tensor, causal: bool, shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """The labels an LM loss predicts, `IGNORE_INDEX` where nothing is predicted: a causal LM predicts token t + 1 at
    position t (`labels[..., 1:]`, or the `shift_labels` given, as Transformers' loss takes them); an
    encoder-decoder predicts its labels as they are."""
    if not causal:
        return labels
    return shift_labels if shift_labels is not None else labels[..., 1:]


def is_target(targets: torch.Tensor) -> torch.Tensor:
    """Bool mask of the target tokens among `targets` (`lm_targets`)."""
    return targets != IGNORE_INDEX


def num_target_tokens(targets: torch.Tensor) -> torch.Tensor:
    """The number of target tokens (a 0-d long tensor, on the device of `targets`)."""
    return is_target(targets).sum()


def warn_if_no_targets(targets: torch.Tensor) -> None:
    """Warn about a batch without a target token (labels all -100, or one-token sequences for a causal LM), whose
    loss is 0 (`model_loss`). An empty target shape is seen everywhere; labels that are all -100 are looked for on
    CPU in eager mode only (elsewhere the host would wait for the device)."""
    if targets.numel() and (targets.device.type != "cpu" or torch.compiler.is_compiling() or bool(is_target(targets).any())):
        return
    warnings.warn(
        "No label in this batch is a target (every label is -100, or each sequence has a single token, which a causal "
        "LM cannot predict from earlier ones): its loss is 0 and it gives no gradient.",
        stacklevel=3,
    )


def router_losses_wanted(requested: bool | None, labels: torch.Tensor | None) -> bool | None:
    """A task head's `compute_router_losses` for its base model: as requested; by default True with labels (the
    loss includes the router losses), else None, which the stacks decide (`blocks.capture_moe_outputs`)."""
    return requested if labels is None else losses_wanted(requested, labels=True)


def router_loss_weight(targets: torch.Tensor, num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor:
    """The weight of one forward's router losses in its `loss`: 1, or its share of the target tokens when the LM loss
    is normalised by `num_items_in_batch`, the target tokens of a whole optimizer step; 0 for a batch without a
    target.

    Transformers' Trainer adds up the losses of a step's micro-batches (and data-parallel replicas), each normalised
    by `num_items_in_batch`: weighted by the token share, a step's router losses add up to their token-weighted mean
    instead of counting once per micro-batch and replica."""
    count = num_target_tokens(targets)
    if num_items_in_batch is None:
        return (count > 0).float()
    return count / torch.as_tensor(num_items_in_batch, device=count.device).clamp(min=1)


class ModelLoss(NamedTuple):
    """`loss`: what to call backward on; `lm_loss`: its language-model part (a mean over the target tokens, or their
    sum divided by `num_items_in_batch` when that is given); `num_target_tokens`: the target tokens of the batch."""

    loss: torch.Tensor
    lm_loss: torch.Tensor
    num_target_tokens: torch.Tensor


def model_loss(lm_loss, targets, num_items_in_batch, config, aux_loss, z_loss) -> ModelLoss:
    """A model's loss: its LM loss plus the router term (`hf_ppmoe.moe.losses.router_loss`) weighted by
    `router_loss_weight`, with its parts. `targets`: the labels the LM loss predicts (`lm_targets`).

    A batch without a target (labels all -100, or one-token sequences for a causal LM) has loss 0 and gives no
    gradient: the LM loss, an average over no tokens (NaN), is replaced by 0, and the router terms weigh 0. Such a
    batch warns (`warn_if_no_targets`); training loops count it by its `num_target_tokens`."""
    warn_if_no_targets(targets)
    count = num_target_tokens(targets)
    lm_loss = torch.where(count > 0, lm_loss, torch.zeros_like(lm_loss))
    loss = lm_loss + router_loss_weight(targets, num_items_in_batch) * router_loss(config, aux_loss, z_loss)
    return ModelLoss(loss, lm_loss, count)


def lm_loss_of(output, labels: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(LM loss, number of target tokens) of a forward given `labels`: the fields our models' outputs carry; a dense
    Transformers model (a baseline trained by the same loop) has only `loss`, which is its LM loss."""
    if getattr(output, "lm_loss", None) is not None:
        return output.lm_loss, output.num_target_tokens
    return output.loss, num_target_tokens(lm_targets(labels, causal))
