"""Transformers' parallel hooks on our models (`from_pretrained(distributed_config=...)`, and
`hf_ppmoe.parallel.parallelize` on a built model), as the mixin `ParallelHooks` of `MoEPreTrainedModel`. The plan
styles our configs name ("ppmoe_ffn", ...) are registered by hf_ppmoe.parallel.
"""

import contextlib
import re

import torch

from ..utils.transformers_private import device_mesh_of, is_first_pipeline_stage, restrict_instance_plans
from .stages import drop_input_parts, keep_layers

_LAYER_NUMBER = re.compile(r"\.\d+(?=\.|$)")  # "layers.3.mlp" -> "layers.*.mlp", as Transformers' plan keys


@contextlib.contextmanager
def tied_head_kept(model):
    """Ties a head that shares the input embeddings' weight again after the block, which may replace the embedding's
    parameter object (tensor-parallel splitting does)."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embeddings is not None and head.weight is embeddings.weight
    yield
    if tied:
        head.weight = embeddings.weight


class ParallelHooks:
    """Put before `PreTrainedModel` in a model base class's bases."""

    def init_parallel_plans(self) -> None:
        """Transformers' plan merging, keeping only the rules that name a module or parameter of this model: the
        configs list the rules of every layout a family can build (gated or plain FFN, biases, shared expert)."""
        super().init_parallel_plans()
        names = {_LAYER_NUMBER.sub(".*", n) for n, _ in [*self.named_modules(), *self.named_parameters()]}
        restrict_instance_plans(self, names.__contains__)

    def keep_own_plan_rules(self, plans: tuple) -> tuple:
        """Transformers' resolved plans (`PrivateHooks`) without the rules of tied duplicates (`lm_head.weight` when
        tied to the input embeddings, which Transformers cannot look up once tied): the shared weight is split once,
        by the embedding's rule, which splits the vocabulary as the head's rule would; the head keeps its forward
        rule."""
        names = {n for n, _ in [*self.named_modules(), *self.named_parameters()]}
        return tuple({k: v for k, v in plan.items() if k in names} for plan in plans)

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """Transformers' `maybe_distribute_model`, keeping a tied head tied; with `pp_size > 1` the GPT-MoE stage is
        completed (`_fit_pipeline_stage`) and an encoder-decoder is refused (Transformers' stages cut the `layers` of
        a decoder-only model)."""
        pipeline = distributed_config is not None and distributed_config.pp_size > 1
        if pipeline and model.config.is_encoder_decoder:
            raise ValueError(
                f"Transformers' pipeline parallelism (DistributedConfig(pp_size={distributed_config.pp_size})) cuts "
                f"the decoder layers of a decoder-only model; {type(model).__name__} has an encoder and a decoder "
                "stack. Use hf_ppmoe.parallel.Pipeline or `python -m hf_ppmoe.training --pp_size N`, which cut both "
                "stacks."
            )
        with tied_head_kept(model):
            model = super().maybe_distribute_model(model, distributed_config, mesh_manager)
        if pipeline:
            model._fit_pipeline_stage()
        return model

    def _fit_pipeline_stage(self) -> None:
        """Completes a GPT-MoE stage of Transformers' pipeline parallelism (`DistributedConfig(pp_size=N)`).

        Transformers keeps this rank's slice of `model.layers` and puts an identity that returns the hidden states
        alone in place of the others; our layers also return their routing and router losses (`layer_outputs`), so
        those identities become `LayerOfAnotherStage`. A stage after the first receives hidden states that already
        carry the learned position embeddings and the embedding dropout, and drops its own. The stages pass
        activations without gradients, so a forward in training is refused (on every rank, before any stage
        communicates) instead of silently updating the last stage alone."""
        base = self.model
        keep_layers(base.layers, range(len(base.layers)))  # Transformers' identities (PipelineIdentityLayer)
        if not is_first_pipeline_stage(self):
            drop_input_parts(base)
        self.register_forward_pre_hook(_refuse_pipeline_training)

    def _distributed_config_of_this_model(self, distributed_config):
        """`config.distributed_config` where this model was split (`_device_mesh`, set by `parallelize` and
        `from_pretrained(distributed_config=...)`), else None: a config shared with, or copied from, a split model
        must not make a model that is whole gather or wait for other ranks when one rank saves it."""
        return distributed_config if device_mesh_of(self) is not None else None

    def gather_sharded_state_dict_for_save(self, model_to_save, state_dict, distributed_config, **kwargs):
        distributed_config = self._distributed_config_of_this_model(distributed_config)
        return super().gather_sharded_state_dict_for_save(model_to_save, state_dict, distributed_config, **kwargs)

    def barrier_after_gathered_checkpoint_save(self, distributed_config) -> None:
        super().barrier_after_gathered_checkpoint_save(self._distributed_config_of_this_model(distributed_config))


def _refuse_pipeline_training(model, args):
    if model.training and torch.is_grad_enabled():
        raise RuntimeError(
            "Transformers' pipeline parallelism (DistributedConfig(pp_size=...)) runs inference only: its stages pass "
            "activations without gradients, so the earlier stages would never learn. Call model.eval() or use "
            "torch.no_grad(); to train with pipeline stages use hf_ppmoe.parallel.Pipeline or "
            "`python -m hf_ppmoe.training --pp_size N`."
        )
