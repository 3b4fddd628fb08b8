"""How a model is cut into pipeline stages, the one way both pipelines use (`hf_ppmoe.parallel.Pipeline` and
Transformers' `DistributedConfig(pp_size=N)`): a stage keeps the layers it holds at their index in the whole model
and holds a `LayerOfAnotherStage` in place of each other one, so parameter names are the whole model's and the model
forwards run unchanged over the stand-ins; a stage after the first drops what belongs to the model's input
(embedding dropout, learned positions: its input carries them). `cut_stack` also drops a stack's input and output
parts where another stage holds them, so a stage runs the stack's own forward (Transformers' pipeline does that part
itself).
"""

from collections.abc import Iterable

import torch
from torch import nn


class NoPositions(nn.Module):
    """Stands in for learned position embeddings on a pipeline stage after the first (its input carries them)."""

    def forward(self, position_ids):
        return 0.0


class LayerOfAnotherStage(nn.Module):
    """Stands in for a layer that another pipeline stage holds: the hidden states pass through, with no routing and
    no router losses (a layer's outputs: hidden_states, aux_loss, z_loss)."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        return hidden_states, None, None


def is_held(layer: nn.Module) -> bool:
    """Whether this stage holds `layer` (not a stand-in for another stage's, ours or Transformers' identity)."""
    return not isinstance(layer, (LayerOfAnotherStage, nn.Identity))


def keep_layers(layers: nn.ModuleList, held: Iterable[int]) -> None:
    """Puts a `LayerOfAnotherStage` in place of every layer of `layers` whose index is not in `held`, and of the
    identities Transformers' pipeline leaves there (which return the hidden states alone)."""
    held = set(held)
    for i, layer in enumerate(layers):
        if i not in held or not is_held(layer):
            layers[i] = LayerOfAnotherStage()


def drop_input_parts(stack: nn.Module) -> None:
    """A stage after the start of `stack`: its input already carries the embedding dropout and learned positions."""
    stack.dropout = nn.Identity()  # applied to the embeddings only
    if getattr(stack.config, "position_embedding_type", None) == "learned":
        stack.embed_positions = NoPositions()


def cut_stack(stack: nn.Module, held: Iterable[int]) -> None:
    """The part of `stack` (a GPT-MoE's `model`, an encoder-decoder's encoder or decoder) that a stage holding its
    layers `held` keeps, so that the stack's own forward runs the stage's part: where the stack's first layer is
    another stage's, the input parts go (token embedding, embedding dropout, learned positions: the stage receives
    hidden states); where its last layer is, the output parts (final norm, output dropout: the next stage applies
    them)."""
    held = set(held)
    keep_layers(stack.layers, held)
    if 0 not in held:
        stack.embed_tokens = None
        drop_input_parts(stack)
    if len(stack.layers) - 1 not in held:
        stack.norm = nn.Identity()
        if hasattr(stack, "output_dropout"):
            stack.output_dropout = nn.Identity()
