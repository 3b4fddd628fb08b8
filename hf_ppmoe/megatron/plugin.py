"""Accelerate's Megatron-LM backend for GPT-MoE: a config parser, a model provider and a train step.

Accelerate reads only the Transformers model's config and builds a fresh megatron-core `GPTModel` (local layer spec,
experts on the tensor-parallel group: the PPMoE layout); weights travel through
`hf_ppmoe.megatron.weights`. Needs CUDA and a Megatron-LM source checkout on PYTHONPATH:

    import hf_ppmoe.megatron.plugin as hm                     # also registers the "gpt_moe" config parser
    plugin = MegatronLMPlugin(tp_degree=2, pp_degree=2, context_parallel_size=1, num_micro_batches=4,
                              custom_model_provider_function=hm.model_provider(model.config),
                              custom_train_step_class=hm.GPTMoETrainStep,
                              custom_train_step_kwargs={"config": model.config},
                              other_megatron_args={"ckpt_format": "torch"})
    accelerator = Accelerator(megatron_lm_plugin=plugin)

How each config field maps, and what Megatron cannot express (refused by `check_megatron_compatible`):
docs/megatron.md.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import torch
import torch.nn.functional as F
from accelerate.utils import AbstractTrainStep, add_model_config_to_megatron_parser

from ..conversion.adapter import FieldMap
from ..modeling.loss import IGNORE_INDEX
from ..moe.gates import TopKGate

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}

# (attention_bias, attention_output_bias, mlp_bias) -> (add_bias_linear, add_qkv_bias): Megatron's only two switches
BIAS_LAYOUTS = {
    (False, False, False): (False, False),
    (True, False, False): (False, True),
    (True, True, True): (True, False),
}


def moe_layer_pattern(config) -> list[int]:
    """Megatron's `moe_layer_freq` list: 1 where layer i is an MoE layer in our model."""
    return [int(config.is_moe_layer(i)) for i in range(config.num_hidden_layers)]


def megatron_incompatibilities(config) -> list[str]:
    """Everything in `config` that a megatron-core GPTModel cannot reproduce exactly (empty list: all fine)."""
    problems = []
    has_moe = any(moe_layer_pattern(config))
    if has_moe and config.router_type not in ("topk", "switch"):
        reason = {
            "gshard": "Megatron has no random routing of the second expert, no group-local capacity that fills all "
            "first routes before second routes, and its load-balancing loss counts both routes (GShard's counts first "
            "choices only); use router_type='topk' with num_experts_per_tok=2",
            "prototype": "Megatron's routers take one softmax over all experts; M6-T prototypes need one softmax and "
            "one top-1 per group of experts (Megatron's group-limited routing selects groups, then top-k across them)",
        }.get(config.router_type, "only the built-in 'topk' and 'switch' gates have a Megatron counterpart")
        problems.append(f"router_type={config.router_type!r}: {reason}.")
    if has_moe and config.router_type == "topk" and config.topk_weighting != "probs":
        problems.append(
            f"topk_weighting={config.topk_weighting!r}: Megatron weights the top-k by their probabilities (optionally "
            "renormalised), not by a softmax over them (M6-T Eq. (1)); use topk_weighting='probs'."
        )
    if has_moe and (config.capacity_factor is not None or config.eval_capacity_factor is not None):
        problems.append(
            f"capacity_factor={config.capacity_factor}, eval_capacity_factor={config.eval_capacity_factor}: Megatron "
            "drops tokens per sequence-parallel shard, by token position or probability and at evaluation too, where "
            "ours drops per group with first-routes-first priority; use dropless routing (both None, the PPMoE "
            "default)."
        )
    if has_moe and config.router_num_groups != 1:
        problems.append(
            f"router_num_groups={config.router_num_groups}: our load-balancing loss is per group, Megatron's per "
            "micro-batch; use router_num_groups=1."
        )
    sigmoid = config.router_score_function == "sigmoid"
    (groups, topk_groups), k = TopKGate.expert_groups(config), config.num_experts_per_tok
    for wrong, message in (
        (sigmoid and k > 1 and not config.norm_topk_prob, "router_score_function='sigmoid' with norm_topk_prob=False: "
         "Megatron renormalises sigmoid top-k weights; use norm_topk_prob=True"),
        (config.router_expert_bias and not sigmoid, "router_expert_bias=True with softmax scores: "
         "Megatron's expert bias needs router_score_function='sigmoid'"),
        (groups > 1 and k // topk_groups != 2, f"num_expert_groups={groups} with num_experts_per_tok // "
         f"topk_expert_groups = {k // topk_groups}: Megatron scores a group by its top k / topk_groups experts, ours by "
         "its top 2"),
        (config.router_aux_loss_scope != "micro_batch", "router_aux_loss_scope="
         f"{config.router_aux_loss_scope!r}: Megatron's seq/global aux losses are computed otherwise "
         "(its global one from a running sum within the step); use 'micro_batch'"),
    ):
        if has_moe and wrong:
            problems.append(message + ".")
    if has_moe and config.router_jitter_noise > 0:
        problems.append(
            f"router_jitter_noise={config.router_jitter_noise}: Megatron's moe_input_jitter_eps also jitters at "
            "evaluation, ours only in training; use 0."
        )
    bias = (config.attention_bias, config.attention_output_bias, config.mlp_bias)
    if bias not in BIAS_LAYOUTS:
        problems.append(
            f"(attention_bias, attention_output_bias, mlp_bias)={bias}: Megatron has two bias switches, "
            "add_bias_linear (every linear layer) and add_qkv_bias (q/k/v only); use all False, only "
            "attention_bias, or all True."
        )
    if has_moe and config.shared_expert_intermediate_size and config.mlp_bias:
        problems.append("shared_expert_intermediate_size with mlp_bias=True: Megatron's shared experts have no biases.")
    if (
        config.position_embedding_type == "rotary"
        and (config.rope_parameters or {}).get("rope_type", "default") != "default"
    ):
        problems.append(
            f"rope_parameters={config.rope_parameters}: only the default rotary embedding (rope_theta) is mapped."
        )
    if config.qk_norm and config.norm_type != "rmsnorm":
        problems.append(
            f"qk_norm=True with norm_type={config.norm_type!r}: Megatron's q/k norms (qk_layernorm) use the model's "
            "normalization, a LayerNorm here, and ours are RMSNorm (Qwen3); use norm_type='rmsnorm'."
        )
    if config.hidden_act not in ACTIVATIONS:
        problems.append(f"hidden_act={config.hidden_act!r}: mapped activations are {', '.join(ACTIVATIONS)}.")
    return problems


def check_megatron_compatible(config) -> None:
    problems = megatron_incompatibilities(config)
    if problems:
        raise ValueError(
            f"This {config.model_type} config cannot be trained with Megatron-LM exactly:\n- " + "\n- ".join(problems)
        )


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's `_vocab_size_with_padding`: rows up to a multiple of make_vocab_size_divisible_by * TP."""
    multiple = divisible_by * tp
    return math.ceil(vocab_size / multiple) * multiple


def _head_dim(config) -> int:
    return config.head_dim or config.hidden_size // config.num_attention_heads


# ours -> megatron-core `TransformerConfig`: the fields that carry one value (the others are computed below)
TRANSFORMER_FIELDS = FieldMap.of(
    "hidden_size", "num_attention_heads", "hidden_dropout", "attention_dropout", num_hidden_layers="num_layers",
    intermediate_size="ffn_hidden_size", num_key_value_heads="num_query_groups", layer_norm_eps="layernorm_epsilon",
    gated_mlp="gated_linear_unit", qk_norm="qk_layernorm", initializer_range="init_method_std")
MOE_FIELDS = FieldMap.of(
    num_experts="num_moe_experts", num_experts_per_tok="moe_router_topk", router_score_function="moe_router_score_function",
    router_expert_bias="moe_router_enable_expert_bias", router_bias_update_rate="moe_router_bias_update_rate")
# `TransformerConfig` fields -> Megatron-LM's arguments: renamed, or not arguments at all (None)
LM_ARGS = {"layernorm_epsilon": "norm_epsilon", "num_moe_experts": "num_experts", "gated_linear_unit": None,
           "activation_func": None, "bias_activation_fusion": None, "window_size": None,
           "moe_router_score_function": None}


def transformer_config_kwargs(config, *, tp: int = 1, pp: int = 1) -> dict:
    """megatron-core `TransformerConfig` fields reproducing `config` with the PPMoE layout on `tp` x `pp` ranks."""
    check_megatron_compatible(config)
    add_bias_linear, add_qkv_bias = BIAS_LAYOUTS[(config.attention_bias, config.attention_output_bias, config.mlp_bias)]
    kwargs = dict(
        TRANSFORMER_FIELDS.theirs(config),
        kv_channels=_head_dim(config),
        normalization="RMSNorm" if config.norm_type == "rmsnorm" else "LayerNorm",
        activation_func=ACTIVATIONS[config.hidden_act],
        bias_activation_fusion=False,  # Megatron's fused bias-GeLU is the tanh approximation whatever the activation
        add_bias_linear=add_bias_linear,
        add_qkv_bias=add_qkv_bias,
        window_size=(config.sliding_window - 1, 0) if config.sliding_window else None,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=tp > 1,
    )
    pattern = moe_layer_pattern(config)
    num_moe = sum(pattern)
    if num_moe:
        groups = config.num_expert_groups
        kwargs.update(
            MOE_FIELDS.theirs(config),
            moe_ffn_hidden_size=config.moe_intermediate_size or config.intermediate_size,
            moe_layer_freq=pattern,
            moe_router_pre_softmax=config.router_type == "switch" or not config.norm_topk_prob,
            moe_router_topk_scaling_factor=config.routed_scaling_factor if config.routed_scaling_factor != 1.0 else None,
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=(config.topk_expert_groups or groups) if groups > 1 else None,
            moe_router_dtype="fp32",  # our softmax is float32 (and with router_dtype="float32" the router GEMM too)
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=config.router_aux_loss_coef / num_moe,
            moe_z_loss_coeff=(config.router_z_loss_coef / num_moe) or None,
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,  # SequentialMLP: per-expert linear_fc1/linear_fc2, the names our converter writes
            moe_shared_expert_intermediate_size=config.shared_expert_intermediate_size or None,
            expert_model_parallel_size=tp,  # PPMoE: the experts live on the tensor-parallel group
            expert_tensor_parallel_size=1,
        )
    return kwargs


def megatron_lm_args(config, *, tp: int = 1, pp: int = 1) -> dict:
    """The same model as Megatron-LM command-line arguments (argparse dest names), for the plugin and checkpoints."""
    kw = transformer_config_kwargs(config, tp=tp, pp=pp)
    args = {LM_ARGS.get(k, k): v for k, v in kw.items() if LM_ARGS.get(k, k)}
    rotary = config.position_embedding_type == "rotary"
    args.update(
        group_query_attention=config.num_key_value_heads != config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        position_embedding_type="rope" if rotary else "learned_absolute",
        use_rotary_position_embeddings=rotary,
        add_position_embedding=config.position_embedding_type == "learned",
        swiglu=config.gated_mlp and config.hidden_act in ("silu", "swish"),
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        orig_vocab_size=config.vocab_size,
        eos_token_id=config.eos_token_id,
        context_parallel_size=1,
    )
    if rotary:
        args.update(rotary_base=config.rope_parameters["rope_theta"], rotary_percent=1.0)
    return args


@add_model_config_to_megatron_parser("gpt_moe")
def parse_gpt_moe_config(megatron_lm_plugin, model, batch_data):
    """Accelerate's config parser for model_type "gpt_moe" (registered on import of this module)."""
    plugin, config = megatron_lm_plugin, model.config
    if plugin.context_parallel_size != 1:
        raise ValueError(
            f"context_parallel_size={plugin.context_parallel_size}: GPT-MoE does not support context parallelism; "
            "pass MegatronLMPlugin(context_parallel_size=1) (Accelerate's default is 2)."
        )
    if plugin.seq_length is None:
        plugin.seq_length = (
            batch_data["input_ids"].shape[1] if batch_data is not None else config.max_position_embeddings
        )
    plugin.megatron_lm_default_args.update(
        megatron_lm_args(config, tp=plugin.tp_degree, pp=plugin.pp_degree),
        model_type_name="gpt",  # Accelerate and Megatron-LM switch on this; our classes replace its builders
        seq_length=plugin.seq_length,
        pretraining_flag=True,
        model_return_dict=config.return_dict,
        return_logits=plugin.return_logits,
        tokenizer_type="HuggingFaceTokenizer",
    )


@add_model_config_to_megatron_parser("seq2seq_moe")
def parse_seq2seq_moe_config(megatron_lm_plugin, model, batch_data):
    """Seq2Seq-MoE has no Megatron counterpart: say why instead of Accelerate's generic "not supported"."""
    raise ValueError(
        "seq2seq_moe cannot be trained with Accelerate's Megatron-LM backend: Accelerate builds encoder-decoders as "
        "megatron.legacy's dense T5Model, megatron-core 0.16.1 has no MoE layer spec for its T5 encoder/decoder "
        "(its MoE layers exist only in GPT specs), and T5 v1.0's tied output embedding rescale (d_model^-0.5) has no "
        "Megatron equivalent. Train seq2seq_moe with hf_ppmoe's own parallelism "
        "(`accelerate launch -m hf_ppmoe.training`)."
    )


def _megatron_lm_args():
    """Megatron-LM's global arguments when running under its training loop (Accelerate's backend), else None."""
    try:
        from megatron.training import get_args  # only a Megatron-LM source checkout has megatron.training
    except ImportError:
        return None
    try:
        return get_args()
    except AssertionError:  # arguments not initialized: megatron-core used on its own
        return None


def build_transformer_config(config, *, tp: int, pp: int, **overrides):
    """The `TransformerConfig`. Under Megatron-LM its training knobs (precision, recomputation, fusions) come from
    its arguments and ours replace every field that defines the model; `overrides` win over both."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = {**transformer_config_kwargs(config, tp=tp, pp=pp), **overrides}
    args = _megatron_lm_args()
    if args is None:  # megatron-core on its own: float32 unless overridden
        return TransformerConfig(**{"pipeline_dtype": kwargs.get("params_dtype", torch.float32), **kwargs})
    from megatron.training.arguments import core_transformer_config_from_args

    return dataclasses.replace(core_transformer_config_from_args(args), **kwargs)


def _drop_router_biases(model) -> None:
    """Megatron gives routers a bias whenever add_bias_linear; our gates have none (and the converter writes none)."""
    from megatron.core.transformer.moe.router import TopKRouter

    for module in model.modules():
        if isinstance(module, TopKRouter) and module.bias is not None:
            del module.bias
            module.bias = None


def _fix_biased_experts(model, expert_parallel_size: int) -> None:
    """Work around two megatron-core 0.16.1 bugs that only biased experts (GPT-2 style) hit:
    - EP = 1 (TP = 1 here): the expert MLP adds its output bias in place (`output += output_bias * probs`,
      transformer/mlp.py) on linear_fc2's output, then an autograd view of a custom Function's input, so training
      raises "Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace". A forward hook
      returns a copy.
    - EP > 1: RowParallelLinear tags every bias `sequence_parallel`, experts' too, so finalize_model_grads sums their
      gradients over the TP group, which with experts on the TP group adds up *different* experts' biases. An
      expert's bias gradient is already complete (it saw every token routed to it), so the tag is removed."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    for module in model.modules():
        if not isinstance(module, SequentialMLP):
            continue
        for expert in module.local_experts:
            if expert_parallel_size == 1:
                expert.linear_fc2.register_forward_hook(lambda _, __, out: (out[0].clone(), *out[1:]))
            else:
                expert.linear_fc2.bias.sequence_parallel = False


def model_provider(config, *, make_vocab_size_divisible_by: int = 128, **config_overrides):
    """`custom_model_provider_function` for `MegatronLMPlugin`: builds this pipeline stage of a megatron-core GPTModel
    equivalent to `GPTMoEForCausalLM(config)`, on the parallel layout of `megatron.core.parallel_state`.

    `make_vocab_size_divisible_by` must match Megatron-LM's argument of that name (default 128): the embedding has
    `padded_vocab_size(vocab_size, TP, make_vocab_size_divisible_by)` rows, as in converted checkpoints.
    `config_overrides` are extra `TransformerConfig` fields (e.g. `use_cpu_initialization=True`).
    """
    check_megatron_compatible(config)

    def provider(pre_process=True, post_process=True, vp_stage=None, **_):
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        tp = ps.get_tensor_model_parallel_world_size()
        pp = ps.get_pipeline_model_parallel_world_size()
        if any(moe_layer_pattern(config)) and ps.get_expert_model_parallel_world_size() != tp:
            raise ValueError(
                f"expert_model_parallel_size={ps.get_expert_model_parallel_world_size()} but tensor parallel size "
                f"is {tp}: GPT-MoE's experts live on the tensor-parallel group (PPMoE), so initialize megatron with "
                "expert_model_parallel_size = tensor_model_parallel_size and expert_tensor_parallel_size = 1."
            )
        vocab = padded_vocab_size(config.vocab_size, tp, make_vocab_size_divisible_by)
        args = _megatron_lm_args()
        if args is not None and args.padded_vocab_size != vocab:
            raise ValueError(
                f"Megatron-LM pads the vocabulary to {args.padded_vocab_size} rows, the provider to {vocab}: pass "
                f"model_provider(..., make_vocab_size_divisible_by={args.make_vocab_size_divisible_by})."
            )
        tc = build_transformer_config(config, tp=tp, pp=pp, **config_overrides)
        spec = get_gpt_decoder_block_spec(
            tc, use_transformer_engine=False, normalization=tc.normalization, vp_stage=vp_stage
        )
        rotary = config.position_embedding_type == "rotary"
        model = GPTModel(
            config=tc,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=config.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=config.tie_word_embeddings,
            position_embedding_type="rope" if rotary else "learned_absolute",
            rotary_base=config.rope_parameters["rope_theta"] if rotary else 10000,
            vp_stage=vp_stage,
        )
        _drop_router_biases(model)
        if config.mlp_bias:
            _fix_biased_experts(model, ps.get_expert_model_parallel_world_size())
        return model

    return provider


# ------------------------------------------------------------------------------------------------------ train step


def megatron_batch(batch: dict, device=None):
    """A Transformers batch -> Megatron's (tokens, labels, loss_mask, attention_mask, position_ids), same loss as HF.

    Megatron's GPTModel returns one loss per position, for the label *at* that position, so HF's shift happens here:
    labels[t] = batch labels[t + 1] (or input_ids[t + 1]), masked where HF ignores it (IGNORE_INDEX, padding, last position).
    The attention mask is None (causal) without padding, else a [B, 1, S, S] bool mask, True = masked.
    """
    input_ids = batch["input_ids"].to(device)
    B, S = input_ids.shape
    valid = batch.get("attention_mask")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if valid is None else valid.to(device).bool()
    targets = batch.get("labels")
    targets = input_ids.masked_fill(~valid, IGNORE_INDEX) if targets is None else targets.to(device)
    labels = torch.cat([targets[:, 1:], targets.new_full((B, 1), IGNORE_INDEX)], dim=1)
    loss_mask = (labels != IGNORE_INDEX).float()
    labels = labels.masked_fill(labels == IGNORE_INDEX, 0)
    attention_mask = None
    if not bool(valid.all()):
        causal = torch.ones(S, S, dtype=torch.bool, device=input_ids.device).triu(1)
        attention_mask = (causal | ~valid[:, None, None, :]).view(B, 1, S, S)
    position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, S)
    return input_ids, labels, loss_mask, attention_mask, position_ids


def _router_loss_totals() -> dict:
    """Per-name sums over layers of megatron-core's router-loss tracker (it accumulates until cleared)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return {name: entry["values"].sum() for name, entry in get_moe_layer_wise_logging_tracker().items()}


class GPTMoETrainStep(AbstractTrainStep):
    """`custom_train_step_class` for `MegatronLMPlugin` (with `custom_train_step_kwargs={"config": model.config}`).

    Optimized objective = HF's `loss`: LM loss + router_aux_loss_coef * aux + router_z_loss_coef * z. The LM loss is
    what `loss_func` returns; megatron-core adds the router losses' gradients itself inside each MoE layer
    (`MoEAuxLossAutoScaler`, coefficients from `transformer_config_kwargs`), which also works across pipeline stages.
    The reported dict has "lm loss" and, without pipeline parallelism, the weighted "aux loss" and "z loss" (read
    from megatron-core's tracker around this micro-batch's forward), so the loss Accelerate returns (their sum)
    equals HF's `loss`. With pipeline parallelism the last stage cannot see the other stages' router losses, so only
    "lm loss" is reported. Values are averaged over data-parallel ranks, like Accelerate's GPTTrainStep.
    """

    def __init__(self, args, *, config):
        super().__init__("GPTMoETrainStep")
        from ..modeling.modeling_gpt_moe import GPTMoECausalLMOutput

        self.config = config
        self.num_moe_layers = sum(moe_layer_pattern(config))
        self.model_output_class = GPTMoECausalLMOutput if getattr(args, "model_return_dict", False) else None
        self.forward_step = self.get_forward_step_func()
        self.loss_func = self.get_loss_func(None)

    def get_batch_func(self, accelerator=None, megatron_dataset_flag=False):
        return megatron_batch

    def get_forward_step_func(self):
        def forward_step(data_iterator, model):
            device = next(model.parameters()).device
            tokens, labels, loss_mask, attention_mask, position_ids = megatron_batch(next(data_iterator), device)
            before = _router_loss_totals()
            output = model(tokens, position_ids, attention_mask, labels=labels)
            router = {name: total - before.get(name, 0.0) for name, total in _router_loss_totals().items()}
            return output, partial(self.loss_func, loss_mask, router)

        return forward_step

    def get_loss_func(self, accelerator=None):
        def loss_func(loss_mask, router_losses, output_tensor):
            from megatron.core import parallel_state as ps

            per_token = output_tensor[0] if isinstance(output_tensor, tuple) else output_tensor  # (losses, logits)
            loss_mask = loss_mask.view(-1).float()
            loss = (per_token.float().view(-1) * loss_mask).sum()
            num_tokens = loss_mask.sum().to(torch.int)
            names, values = ["lm loss"], [loss.detach() / num_tokens]
            if self.num_moe_layers and ps.get_pipeline_model_parallel_world_size() == 1 and router_losses:
                names, values = self._add_router_losses(names, values, router_losses, ps)
            reported = torch.stack(values)
            if ps.get_data_parallel_world_size() > 1:
                torch.distributed.all_reduce(reported, group=ps.get_data_parallel_group())
                reported /= ps.get_data_parallel_world_size()
            return loss, num_tokens, dict(zip(names, reported, strict=True))

        return loss_func

    def _add_router_losses(self, names, values, router_losses, ps):
        # the tracker holds, per rank, aux / coeff with this rank's sequence shard of the probabilities (partial sums:
        # add them over the TP group) and the mean z over this rank's tokens (average over the TP group)
        tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
        zero = values[0].new_zeros(())
        aux = router_losses.get("load_balancing_loss", zero).detach().float().reshape(())
        z = router_losses.get("z_loss", zero).detach().float().reshape(())
        both = torch.stack([aux, z / tp])
        if tp > 1:
            torch.distributed.all_reduce(both, group=tp_group)
        scale = torch.tensor([self.config.router_aux_loss_coef, self.config.router_z_loss_coef]) / self.num_moe_layers
        weighted = both * scale.to(both.device)
        return names + ["aux loss", "z loss"], values + [weighted[0], weighted[1]]
