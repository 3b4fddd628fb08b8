"""T5 (v1.0, v1.1) and Switch Transformers <-> Seq2Seq-MoE, both ways; Switch's dense twin is T5.

A T5 becomes a Seq2Seq-MoE whose logits and generations equal T5's; upcycling then turns its chosen FFNs into MoE
layers (upcycling.py). Weights are only renamed ({s}: encoder or decoder; FFN sublayer f: 1 in the encoder, 2 in the
decoder):

    shared                                        model.shared  (both stacks' embed_tokens are tied to it)
    lm_head (when stored: an untied head)         lm_head
    {s}.block.0.layer.0.SelfAttention
        .relative_attention_bias                  model.{s}.relative_attention_bias  (one table per stack)
    {s}.block.{i}.layer.0.layer_norm              model.{s}.layers.{i}.input_layernorm
    {s}.block.{i}.layer.0.SelfAttention.{q,k,v,o} model.{s}.layers.{i}.self_attn.{q,k,v,o}_proj
    decoder.block.{i}.layer.1.layer_norm          model.decoder.layers.{i}.cross_attn_layernorm
    decoder.block.{i}.layer.1.EncDecAttention.*   model.decoder.layers.{i}.cross_attn.*_proj
    {s}.block.{i}.layer.{f}.layer_norm            model.{s}.layers.{i}.post_attention_layernorm
    ...DenseReluDense.wi (v1.0)                   ...mlp.up_proj
    ...DenseReluDense.wi_0, wi_1 (v1.1), wo       ...mlp.gate_proj, mlp.up_proj, mlp.down_proj
    {s}.final_layer_norm                          model.{s}.norm

Switch Transformers has T5's layout with `mlp` for `DenseReluDense`; its sparse FFNs are MoE layers:

    ...layer.{f}.mlp.router.classifier            ...mlp.gate.weight [E, H]
    ...layer.{f}.mlp.experts.expert_{e}.wi        ...mlp.experts.up_proj [E, I, H]  (stacked nn.Linear weights)
    ...layer.{f}.mlp.experts.expert_{e}.wo        ...mlp.experts.down_proj [E, H, I]

What Switch computes (Transformers 5.24, `models/switch_transformers`): T5 v1.0's layout, top-1 router (softmax in
float32, the expert weighted by its probability), sparse blocks where i % step == 1 (every block for step 1) with
step = num_layers // num_sparse_layers per stack; `expert_capacity` tokens per expert and sequence, dropped past it
in training and evaluation alike (exported as 2**31 - 1: dropless, like ours; imported dropless); jitter multiplied in
place into the hidden states the experts also read (float32); dropout_rate on embeddings, residuals, attention and
inside every FFN.

Tied heads. Transformers 5 always says tie_word_embeddings=True for T5; a checkpoint shows an untied head (real
v1.1 checkpoints) by storing lm_head.weight, and Transformers unties it on loading. So the tables read the source's
tensor names: an lm_head.weight among them is an untied head. The head is fed decoder_output * d_model**-0.5 when
`scale_decoder_outputs` (T5 v1.0; Switch when tie_word_embeddings). Stored copies of the embedding
(`{s}.embed_tokens`, as untied Switch models save them) must equal `shared`: Seq2Seq-MoE has one embedding.
"""

from __future__ import annotations

from types import SimpleNamespace

from transformers import T5Config

from ..modeling.configuration_seq2seq_moe import Seq2SeqMoEConfig
from ..modeling.modeling_seq2seq_moe import Seq2SeqMoEForConditionalGeneration
from .adapter import Architecture, FieldMap, routing_reasons, weighting
from .choices import EXPORT_CLASSES
from .mapping import ConversionError, Mapping, Rule, Same, Stack, materialize, rename

# a relative attention bias old T5 checkpoints store for cross-attention, which T5 never uses
T5_IGNORED = (r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$",)
STACKS = (("encoder", 1), ("decoder", 2))  # (stack, index of the FFN sublayer in each block)
# Switch drops tokens past `expert_capacity` per expert and sequence, in evaluation too; ours is dropless
DROPLESS_EXPERT_CAPACITY = 2**31 - 1

FIELDS = FieldMap.of("vocab_size", "num_decoder_layers", "relative_attention_num_buckets", "relative_attention_max_distance",
                     "use_cache", "pad_token_id", "eos_token_id", "dtype", hidden_size="d_model", intermediate_size="d_ff",
                     num_hidden_layers="num_layers", num_attention_heads="num_heads",
                     layer_norm_eps="layer_norm_epsilon", hidden_dropout="dropout_rate")
SWITCH = FieldMap.of("num_experts", "router_aux_loss_coef", "router_z_loss_coef", hidden_act="dense_act_fn")


def _depth(config, stack: str) -> int:
    return config.num_layers if stack == "encoder" else config.num_decoder_layers


def _fields(c, names, *, gated: bool, scale: bool) -> dict:
    """A T5 or Switch config -> ours (their tensor `names` tell whether the head is tied)."""
    start = getattr(c, "decoder_start_token_id", None)
    return FIELDS.ours(c) | dict(
        head_dim=c.d_kv,
        hidden_act=c.dense_act_fn,
        gated_mlp=gated,
        attention_scaling=1.0,  # T5 does not scale q.k; its query init carries the scale
        norm_type="rmsnorm",
        attention_dropout=c.dropout_rate,
        tie_word_embeddings="lm_head.weight" not in names,
        scale_decoder_outputs=scale,
        decoder_start_token_id=start if start is not None else c.pad_token_id,
    )


def _config_fields(c) -> dict:
    """Ours -> what T5's and Switch's configs share."""
    return FIELDS.theirs(c) | dict(
        d_kv=c.head_dim or c.hidden_size // c.num_attention_heads,
        tie_word_embeddings=c.scale_decoder_outputs,  # Transformers 5 reads it as "rescale the head's input"
        decoder_start_token_id=c.decoder_start_token_id,
    )


def _rules(config, names, ffn_rules) -> list[Rule]:
    """Everything but the FFNs, which `ffn_rules(stack, i, t5_prefix, our_prefix)` maps."""
    copies = ("shared.weight", *(n for n in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight") if n in names))
    rules = [Rule(copies, ("model.shared.weight",), Same(len(copies)))]
    if "lm_head.weight" in names:
        rules.append(rename("lm_head.weight", "lm_head.weight"))
    for stack, f in STACKS:
        bias = "relative_attention_bias.weight"
        rules += [
            rename(f"{stack}.block.0.layer.0.SelfAttention.{bias}", f"model.{stack}.{bias}"),
            rename(f"{stack}.final_layer_norm.weight", f"model.{stack}.norm.weight"),
        ]
        for i in range(_depth(config, stack)):
            t5, ours = f"{stack}.block.{i}.layer.", f"model.{stack}.layers.{i}."
            rules.append(rename(f"{t5}0.layer_norm.weight", f"{ours}input_layernorm.weight"))
            rules += [rename(f"{t5}0.SelfAttention.{p}.weight", f"{ours}self_attn.{p}_proj.weight") for p in "qkvo"]
            if stack == "decoder":
                rules.append(rename(f"{t5}1.layer_norm.weight", f"{ours}cross_attn_layernorm.weight"))
                rules += [rename(f"{t5}1.EncDecAttention.{p}.weight", f"{ours}cross_attn.{p}_proj.weight") for p in "qkvo"]
            rules.append(rename(f"{t5}{f}.layer_norm.weight", f"{ours}post_attention_layernorm.weight"))
            rules += ffn_rules(stack, i, f"{t5}{f}.", f"{ours}mlp.")
    return rules


def _dense_ffn(module: str, gated: bool):
    pairs = ([("wi_0", "gate_proj"), ("wi_1", "up_proj")] if gated else [("wi", "up_proj")]) + [("wo", "down_proj")]
    return lambda t5, ours: [rename(f"{t5}{module}.{a}.weight", f"{ours}{b}.weight") for a, b in pairs]


# ------------------------------------------------------------------------------------------------------- T5


def t5_fields(c: T5Config, names=frozenset()) -> dict:
    return _fields(c, names, gated=c.is_gated_act, scale=c.scale_decoder_outputs)


def t5_rules(config: T5Config, names=frozenset(), **_) -> list[Rule]:
    """T5 names -> Seq2Seq-MoE names; `names`: the source checkpoint's tensor names (see "Tied heads")."""
    dense = _dense_ffn("DenseReluDense", config.is_gated_act)
    return _rules(config, names, lambda stack, i, t5, ours: dense(t5, ours))


def config_from_t5(t5: T5Config, tied_head: bool | None = None) -> Seq2SeqMoEConfig:
    """The Seq2Seq-MoE config (no MoE layers) that computes exactly what `t5` does. tied_head: whether the LM head
    is the embedding (default: as real checkpoints are, tied for v1.0, untied for v1.1)."""
    tied = t5.scale_decoder_outputs if tied_head is None else tied_head
    return Seq2SeqMoEConfig(
        **t5_fields(t5, frozenset() if tied else {"lm_head.weight"}), encoder_moe_layers=[], decoder_moe_layers=[]
    )


def config_to_t5(config: Seq2SeqMoEConfig) -> T5Config:
    """The T5 config of a dense Seq2Seq-MoE; ConversionError where T5 cannot express it. (Whether the head is tied
    shows in the checkpoint: T5 unties a stored lm_head.weight.)"""
    problems = [
        text
        for bad, text in (
            (config.norm_type != "rmsnorm", "norm_type must be 'rmsnorm'"),
            (config.attention_scaling != 1.0, "attention_scaling must be 1.0"),
            (config.attention_bias or config.mlp_bias, "T5 has no biases"),
            (config.attention_dropout != config.hidden_dropout, "T5 has one dropout_rate"),
            (any(map(config.is_encoder_moe_layer, range(config.num_hidden_layers))), "the encoder has MoE layers"),
            (any(map(config.is_decoder_moe_layer, range(config.num_decoder_layers))), "the decoder has MoE layers"),
        )
        if bad
    ]
    if problems:
        raise ConversionError(f"This Seq2Seq-MoE config is not a T5: {'; '.join(problems)}.")
    act = config.hidden_act
    feed_forward = ("gated-gelu" if act == "gelu_new" else f"gated-{act}") if config.gated_mlp else act
    t5 = T5Config(**_config_fields(config), feed_forward_proj=feed_forward)
    t5.architectures = ["T5ForConditionalGeneration"]
    return t5


def from_t5(t5_model) -> Seq2SeqMoEForConditionalGeneration:
    """A `T5ForConditionalGeneration` -> the dense Seq2SeqMoEForConditionalGeneration with the same outputs, in
    memory (`upcycle` writes MoE models; this is its dense starting point)."""
    from .io import model_tensors

    tensors = model_tensors(t5_model)
    names = frozenset(tensors.keys())
    config = Seq2SeqMoEConfig(**t5_fields(t5_model.config, names), encoder_moe_layers=[], decoder_moe_layers=[])
    state = materialize(Mapping(t5_rules(t5_model.config, names), ignore=T5_IGNORED).apply(tensors))
    model = Seq2SeqMoEForConditionalGeneration(config).to(t5_model.dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    untied_missing = set(missing) - set(model.all_tied_weights_keys)  # tied copies of model.shared are not stored
    if unexpected or untied_missing:
        raise ConversionError(f"T5 weights do not fit: missing {sorted(untied_missing)}, unexpected {sorted(unexpected)}")
    return model.train(t5_model.training)


def t5_ffn_modules(c) -> list[str]:
    """The dense FFN module of every layer, encoder then decoder (what a router sees is its input)."""
    return [f"{stack}.block.{i}.layer.{f}.DenseReluDense" for stack, f in STACKS for i in range(_depth(c, stack))]


# --------------------------------------------------------------------------------------- Switch Transformers


def switch_sparse_layers(c, stack: str) -> list[int]:
    """The blocks Transformers' Switch Transformers builds sparse: i % step == 1 (every block when step == 1)."""
    step = c.encoder_sparse_step if stack == "encoder" else c.decoder_sparse_step
    return [i for i in range(_depth(c, stack)) if step > 0 and (i % step == 1 or step == 1)]


def _sparse_count(moe: list[bool]) -> int | None:
    """num_sparse_layers for which Switch Transformers builds exactly the MoE layers `moe` of a stack, or None."""
    n = len(moe)
    for count in range(n + 1):
        step = n // count if count else n  # SwitchTransformersConfig.__post_init__
        stack = SimpleNamespace(num_layers=n, encoder_sparse_step=step)
        if [i in switch_sparse_layers(stack, "encoder") for i in range(n)] == moe:
            return count
    return None


def _our_moe_layers(c) -> dict[str, list[bool]]:
    return {
        "encoder": [c.is_encoder_moe_layer(i) for i in range(c.num_hidden_layers)],
        "decoder": [c.is_decoder_moe_layer(i) for i in range(c.num_decoder_layers)],
    }


def switch_rules(c, names=frozenset(), **_) -> list[Rule]:
    sparse = {stack: set(switch_sparse_layers(c, stack)) for stack, _ in STACKS}
    dense = _dense_ffn("mlp", gated=False)

    def ffn(stack, i, t5, ours):
        if i not in sparse[stack]:
            return dense(t5, ours)
        experts = f"{t5}mlp.experts.expert_{{e}}."
        return [  # nn.Linear [out, in] per expert -> our [E, out, in]
            rename(f"{t5}mlp.router.classifier.weight", f"{ours}gate.weight"),
            rename(experts + "wi.weight", f"{ours}experts.up_proj", Stack()),
            rename(experts + "wo.weight", f"{ours}experts.down_proj", Stack()),
        ]

    return _rules(c, names, ffn)


def switch_fields(c, names=frozenset()) -> dict:
    """Switch's router as our "switch" gate, with router_dtype="float32" as Switch's. Refused: a router bias (ours
    has none), a router dtype other than float32 (ours: float32 or the activations'), a gated FFN (Transformers'
    Switch has none). Its expert_capacity, an absolute number of tokens per expert and sequence that also drops
    tokens in evaluation, has no counterpart: the import is dropless (capacity_factor=None; pass one to train with a
    capacity), so its logits equal Switch's whenever no expert receives more than expert_capacity tokens of a
    sequence."""
    refused = [
        text
        for bad, text in (
            (c.router_bias, "router_bias=True (our gate has no bias)"),
            (c.router_dtype != "float32", f"router_dtype={c.router_dtype!r} (our router GEMM runs in float32 or in "
             "the activations' dtype; set router_dtype to 'float32' in config.json to accept that)"),
            (c.dense_act_fn.startswith("gated-"), f"dense_act_fn={c.dense_act_fn!r} (Switch's FFNs are not gated)"),
        )
        if bad
    ]
    if refused:
        raise ConversionError(f"This Switch Transformers checkpoint cannot be imported: {'; '.join(refused)}.")
    return _fields(c, names, gated=False, scale=c.tie_word_embeddings) | SWITCH.ours(c) | dict(
        num_experts_per_tok=1,
        router_type="switch",
        capacity_factor=None,
        eval_capacity_factor=None,
        router_jitter_noise=c.router_jitter_noise,
        router_dtype="float32",
        encoder_moe_layers=switch_sparse_layers(c, "encoder"),
        decoder_moe_layers=switch_sparse_layers(c, "decoder"),
    )


def _switch_config(c):
    from transformers import SwitchTransformersConfig

    layers = _our_moe_layers(c)
    return SwitchTransformersConfig(
        **_config_fields(c),
        **SWITCH.theirs(c),
        bos_token_id=c.bos_token_id,
        expert_capacity=DROPLESS_EXPERT_CAPACITY,
        num_sparse_encoder_layers=_sparse_count(layers["encoder"]),
        num_sparse_decoder_layers=_sparse_count(layers["decoder"]),
        router_bias=False,
        router_jitter_noise=0.0,
        router_dtype="float32",  # Switch's only exact choice; ours with router_dtype=None computes the GEMM in the
        # activations' dtype, the same in float32 (the dtype the export checks)
    )


def _switch_reasons(c) -> list[str]:
    label = "Switch Transformers"
    renormalized, reasons = weighting(c, label)
    if c.num_experts_per_tok != 1:
        reasons.append(f"num_experts_per_tok={c.num_experts_per_tok}; {label} routes every token to one expert")
    elif renormalized == "renormalized":
        reasons.append(f"the one route's weight is renormalised to 1 (router_type={c.router_type!r}); {label} "
                       "weights the expert by its probability")
    for stack, moe in _our_moe_layers(c).items():
        if _sparse_count(moe) is None:
            reasons.append(
                f"{stack} MoE layers {[i for i, m in enumerate(moe) if m]} of {len(moe)}: {label} builds sparse blocks "
                "only where i % step == 1 (all blocks for step 1), step = num_layers // num_sparse_layers"
            )
    checks = [
        (c.gated_mlp, f"a gated FFN (gated_mlp=True); {label}'s FFNs are act(wi x) without a gate"),
        (c.norm_type != "rmsnorm", f"norm_type={c.norm_type!r}; {label} uses T5's RMSNorm"),
        (c.attention_scaling != 1.0, f"attention_scaling={c.attention_scaling} (None: head_dim**-0.5); {label} "
         "does not scale q.k (1.0)"),
        (c.attention_bias or c.mlp_bias, f"biases (attention_bias={c.attention_bias}, mlp_bias={c.mlp_bias}); "
         f"{label} has none"),
        (c.hidden_dropout > 0 or c.attention_dropout > 0, f"dropout (hidden_dropout={c.hidden_dropout}, "
         f"attention_dropout={c.attention_dropout}); {label}'s dropout_rate also drops inside every FFN, ours does "
         "not (set both to 0 before exporting)"),
        (c.shared_expert_intermediate_size > 0, f"a shared expert (shared_expert_intermediate_size="
         f"{c.shared_expert_intermediate_size}); {label} has none"),
        (c.moe_intermediate_size not in (None, c.intermediate_size), f"moe_intermediate_size="
         f"{c.moe_intermediate_size} != intermediate_size={c.intermediate_size}; {label}'s experts have the dense "
         "FFN's size d_ff"),
        (c.tie_word_embeddings and not c.scale_decoder_outputs, f"a head tied to the embeddings without the "
         f"d_model**-0.5 rescaling (tie_word_embeddings=True, scale_decoder_outputs=False); {label} ties its head "
         "only together with that rescaling"),
    ]
    return reasons + [text for bad, text in checks if bad] + routing_reasons(c, label, jitters=True)


ARCHITECTURES = [
    Architecture("t5", "T5ForConditionalGeneration", t5_fields, t5_rules, "seq2seq_moe", base_prefix="", ignore=T5_IGNORED,
                 ffn_modules=t5_ffn_modules, config=config_to_t5),
    Architecture("switch_transformers", EXPORT_CLASSES["switch_transformers"], switch_fields, switch_rules, "seq2seq_moe",
                 base_prefix="", ignore=T5_IGNORED, moe=True, twin="t5", config=_switch_config, reasons=_switch_reasons),
]

__all__ = ["config_from_t5", "config_to_t5", "from_t5"]
