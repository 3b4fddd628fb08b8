"""Checks of a forward's inputs, and the padding mask the MoE layers route with."""

import torch


def routing_token_mask(attention_mask: torch.Tensor | None, compute_router_losses: bool) -> torch.Tensor | None:
    """The padding mask the MoE layers route with: a 2D attention mask [B, S] (0 for padding), or None for no
    padding. In inference a mask without padding (every decoding step of `generate`) becomes None, checked once per
    forward, so that no MoE layer spends operators on it. The check reads the mask on the host, so it is made only on
    CPU in eager mode: training, GPUs and torch.compile keep the mask (same numbers) and never wait for the device."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    if (
        not compute_router_losses
        and attention_mask.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and bool(attention_mask.all())
    ):
        return None
    return attention_mask


def check_tokens(shape: torch.Size, name: str) -> None:
    """A batch of B >= 1 sequences of L >= 1 tokens (checked from the shape: no device work)."""
    if len(shape) < 2 or shape[0] == 0 or shape[1] == 0:
        raise ValueError(
            f"{name} has shape {tuple(shape)}: the model takes a batch [batch, sequence length] with at least one "
            "sequence of at least one token."
        )


def check_ids(ids: torch.Tensor, limit: int, what: str, fix: str) -> None:
    """Raise ValueError if an id lies outside [0, limit). Checked on CPU in eager mode only, where it is two
    comparisons: on an accelerator, or under torch.compile, reading the answer would make the host wait for the
    device (or break the graph) on every step, so there the embedding's own device-side index check stops a bad id."""
    if ids.device.type != "cpu" or torch.compiler.is_compiling() or ids.numel() == 0:
        return
    low, high = ids.aminmax()  # one pass
    if low.item() < 0 or high.item() >= limit:
        where = tuple(((ids < 0) | (ids >= limit)).nonzero()[0].tolist())
        raise ValueError(f"{what} must lie in [0, {limit}); got {int(ids[where])} at index {list(where)}. {fix}")
