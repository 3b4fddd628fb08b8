"""GPT-MoE checkpoints <-> Megatron-LM checkpoints of the megatron-core GPTModel that
`hf_ppmoe.megatron.plugin` builds (experts on the tensor-parallel group). Needs torch only.

Both directions are `conversion/mapping.py` tables and ops (`rules`, `SHARDING`), so the round trip is bit-exact. On disk:
Megatron-LM's legacy "torch" format (`release/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`), written through a
temporary folder renamed into place. Name and layout tables: docs/megatron.md. Command line:

    hf-ppmoe megatron to-megatron HF_DIR MEGATRON_DIR --tp 2 --pp 2
    hf-ppmoe megatron to-hf MEGATRON_DIR HF_DIR --config HF_DIR_OR_CONFIG_JSON
"""

from __future__ import annotations

import argparse
import pickle
import re
from pathlib import Path

import torch

from ..utils.atomic import atomic_folder
from ..conversion.mapping import (
    Concat,
    ConversionError,
    Copies,
    DictSource,
    InterleaveQKV,
    Mapping,
    PadRows,
    Rule,
    Split,
    Unstack,
    materialize,
    rename,
    shape_str,
)


def _mlp_rules(hf: str, mc: str, config) -> list[Rule]:
    """A dense FFN (or the shared expert): gate/up/down nn.Linear <-> Megatron MLP linear_fc1/linear_fc2."""
    params = ("weight", "bias") if config.mlp_bias else ("weight",)
    out = []
    for p in params:
        if config.gated_mlp:  # [gate; up]: Megatron's GLU takes the first half as the gate
            out.append(Rule((f"{hf}gate_proj.{p}", f"{hf}up_proj.{p}"), (f"{mc}linear_fc1.{p}",), Concat(0, 2)))
        else:
            out.append(rename(f"{hf}up_proj.{p}", f"{mc}linear_fc1.{p}"))
        out.append(rename(f"{hf}down_proj.{p}", f"{mc}linear_fc2.{p}"))
    return out


def rules(config, padded_vocab: int) -> list[Rule]:
    """Every tensor of `GPTMoEForCausalLM(config)` and its megatron-core counterpart(s), layer by layer."""
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    qkv = InterleaveQKV(config.num_attention_heads, config.num_key_value_heads, head_dim)
    norm = ("weight", "bias") if config.norm_type == "layernorm" else ("weight",)
    vocab = PadRows(config.vocab_size, padded_vocab)
    table = [rename("model.embed_tokens.weight", "embedding.word_embeddings.weight", vocab)]
    if config.position_embedding_type == "learned":
        table.append(rename("model.embed_positions.weight", "embedding.position_embeddings.weight"))
    for i in range(config.num_hidden_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        for p in norm:
            table.append(rename(f"{hf}input_layernorm.{p}", f"{mc}input_layernorm.{p}"))
            table.append(rename(f"{hf}post_attention_layernorm.{p}", f"{mc}pre_mlp_layernorm.{p}"))
        for p in ("weight", "bias") if config.attention_bias else ("weight",):
            names = tuple(f"{hf}self_attn.{x}_proj.{p}" for x in "qkv")
            table.append(Rule(names, (f"{mc}self_attention.linear_qkv.{p}",), qkv))
        for p in ("weight", "bias") if config.attention_output_bias else ("weight",):
            table.append(rename(f"{hf}self_attn.o_proj.{p}", f"{mc}self_attention.linear_proj.{p}"))
        if config.qk_norm:  # [head_dim], replicated over tensor-parallel ranks
            table += [rename(f"{hf}self_attn.{x}_norm.weight", f"{mc}self_attention.{x}_layernorm.weight") for x in "qk"]
        if not config.is_moe_layer(i):
            table += _mlp_rules(f"{hf}mlp.", f"{mc}mlp.", config)
            continue
        table.append(rename(f"{hf}mlp.gate.weight", f"{mc}mlp.router.weight"))
        if config.router_expert_bias:  # Megatron-core's TopKRouter buffer of the same meaning
            table.append(rename(f"{hf}mlp.gate.expert_bias", f"{mc}mlp.router.expert_bias"))
        experts, local = f"{hf}mlp.experts.", f"{mc}mlp.experts.local_experts.{{e}}."
        fc1 = "gate_up_proj" if config.gated_mlp else "up_proj"
        per_expert = Unstack()  # our [E, out, in] -> one nn.Linear [out, in] per expert
        table.append(rename(f"{experts}{fc1}", f"{local}linear_fc1.weight", per_expert))
        table.append(rename(f"{experts}down_proj", f"{local}linear_fc2.weight", per_expert))
        if config.mlp_bias:
            table.append(rename(f"{experts}{fc1}_bias", f"{local}linear_fc1.bias", Unstack()))
            table.append(rename(f"{experts}down_proj_bias", f"{local}linear_fc2.bias", Unstack()))
        if config.shared_expert_intermediate_size:
            table += _mlp_rules(f"{hf}mlp.shared_expert.", f"{mc}mlp.shared_experts.", config)
    for p in norm:
        table.append(rename(f"model.norm.{p}", f"decoder.final_layernorm.{p}"))
    if not config.tie_word_embeddings:
        table.append(rename("lm_head.weight", "output_layer.weight", vocab))
    return table


def mapping(config, padded_vocab: int) -> Mapping:
    return Mapping(rules(config, padded_vocab), num_experts=config.num_experts)


# (pattern, split over tensor-parallel ranks); first match wins. "fc1" is "glu" for gated MLPs, else "column".
SHARDING = [
    (re.compile(r"\.local_experts\.\d+\."), "expert"),
    (re.compile(r"\.linear_fc1\.(weight|bias)$"), "fc1"),
    (re.compile(r"(linear_qkv\.(weight|bias)|word_embeddings\.weight|output_layer\.weight)$"), "column"),
    (re.compile(r"(linear_proj|linear_fc2)\.weight$"), "row"),
    (re.compile(r""), "replicated"),
]
LINEAR = re.compile(r"^(.*\.(linear_qkv|linear_proj|linear_fc1|linear_fc2))\.weight$")
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")


def split_kind(name: str, gated: bool) -> str:
    kind = next(kind for pattern, kind in SHARDING if pattern.search(name))
    return ("glu" if gated else "column") if kind == "fc1" else kind


def tp_op(kind: str, tp: int):
    """The op that splits a tensor of this kind into its `tp` tensor-parallel parts (its inverse joins them)."""
    return {
        "column": Split(0, tp),
        "row": Split(1, tp),
        "glu": Split(0, tp, blocks=2),  # rank r holds [gate_r; up_r]
        "replicated": Copies(tp, "rank"),
    }[kind]


def _merge(name: str, parts: list[torch.Tensor], kind: str) -> torch.Tensor:
    if len({p.shape for p in parts}) != 1:
        raise ConversionError(f"{name}: shapes differ between tensor-parallel ranks: {[shape_str(p) for p in parts]}")
    try:
        (merged,) = tp_op(kind, len(parts)).inverse()(parts)
    except ConversionError as err:  # only `Same` checks anything: replicated parts must be equal
        raise ConversionError(f"{name} is replicated over tensor-parallel ranks but {err}") from err
    return merged


# ------------------------------------------------------------------------------------------------ whole-model maps


def expected_hf_shapes(config) -> dict[str, torch.Size]:
    from ..modeling import GPTMoEForCausalLM

    with torch.device("meta"):
        model = GPTMoEForCausalLM(config)
    return {k: v.shape for k, v in model.state_dict().items()}


def _check_hf(state_dict: dict, config) -> None:
    expected = expected_hf_shapes(config)
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong = [
        f"{k}: {shape_str(state_dict[k])}, config expects {list(expected[k])}"
        for k in expected
        if k in state_dict and state_dict[k].shape != expected[k]
    ]
    if missing or unexpected or wrong:
        raise ConversionError(
            "GPT-MoE weights do not match the config: "
            + "; ".join(
                f"{what}: {items}"
                for what, items in [("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)]
                if items
            )
        )


def hf_to_mcore(state_dict: dict, config, padded_vocab: int) -> dict[str, torch.Tensor]:
    """Our state dict -> the unsharded megatron-core GPTModel state dict (without `_extra_state` entries)."""
    _check_hf(state_dict, config)
    if config.tie_word_embeddings:
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    return materialize(mapping(config, padded_vocab).apply(DictSource(state_dict, "the GPT-MoE state dict")))


def mcore_to_hf(full: dict, config) -> dict[str, torch.Tensor]:
    """The unsharded megatron-core state dict -> our state dict (lm_head.weight = the embedding when tied)."""
    padded = full.get("embedding.word_embeddings.weight")
    table = mapping(config, padded.shape[0] if padded is not None else config.vocab_size)
    wanted = {name for instance in table.instances() for name in instance.targets}
    have = {k: v for k, v in full.items() if not k.endswith("._extra_state")}
    if wanted != set(have):
        raise ConversionError(
            "Megatron tensors do not match the config: "
            f"missing {sorted(wanted - set(have))}, unexpected {sorted(set(have) - wanted)}"
        )
    out = materialize(table.inverse().apply(DictSource(have, "the Megatron checkpoint")))
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    _check_hf(out, config)
    return out


# ------------------------------------------------------------------------------------------- TP / EP / PP sharding


def _layout(config, tp: int, pp: int) -> tuple[int, int]:
    """(layers per stage, experts per rank), after checking that the layout divides the model evenly."""
    problems = []
    if config.num_hidden_layers % pp:
        problems.append(f"num_hidden_layers={config.num_hidden_layers} is not divisible by PP={pp}")
    if config.num_key_value_heads % tp:
        problems.append(f"num_key_value_heads={config.num_key_value_heads} is not divisible by TP={tp}")
    for name in ("num_attention_heads", "intermediate_size"):
        if getattr(config, name) % tp:
            problems.append(f"{name}={getattr(config, name)} is not divisible by TP={tp}")
    has_moe = any(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    if has_moe and config.num_experts % tp:
        problems.append(
            f"num_experts={config.num_experts} is not divisible by TP={tp} (the experts live on the TP group)"
        )
    if has_moe and config.shared_expert_intermediate_size % tp:
        problems.append(
            f"shared_expert_intermediate_size={config.shared_expert_intermediate_size} is not divisible by TP={tp}"
        )
    if problems:
        raise ConversionError("; ".join(problems))
    return config.num_hidden_layers // pp, config.num_experts // tp


def shard(full: dict, config, *, tp: int = 1, pp: int = 1) -> dict[tuple[int, int], dict]:
    """Unsharded megatron-core state dict -> {(tp_rank, pp_rank): that rank's GPTModel.state_dict()}."""
    per_stage, per_rank = _layout(config, tp, pp)
    shards = {(t, p): {} for p in range(pp) for t in range(tp)}
    if config.tie_word_embeddings and pp > 1:  # the last stage holds a copy of the embedding as its output layer
        full = {**full, "output_layer.weight": full["embedding.word_embeddings.weight"]}
    for name, tensor in full.items():
        stage, local = 0, name
        if m := LAYER.match(name):
            stage = int(m.group(1)) // per_stage
            local = f"decoder.layers.{int(m.group(1)) % per_stage}.{m.group(2)}"
        elif name.startswith(("decoder.final_layernorm", "output_layer")):
            stage = pp - 1
        kind = split_kind(local, config.gated_mlp)
        if kind == "expert":
            prefix, e, suffix = EXPERT.match(local).groups()
            shards[(int(e) // per_rank, stage)][f"{prefix}{int(e) % per_rank}{suffix}"] = tensor.clone()
            continue
        for t, part in enumerate(tp_op(kind, tp)([tensor])):
            shards[(t, stage)][local] = part.clone()
    for (_, p), sd in shards.items():  # Megatron's linear layers carry an (empty) extra state; strict loading wants it
        sd.update({f"{m.group(1)}._extra_state": None for k in list(sd) if (m := LINEAR.match(k))})
        if p == pp - 1:
            sd["output_layer._extra_state"] = None
    return shards


def unshard(shards: dict[tuple[int, int], dict], config, *, tp: int, pp: int) -> dict[str, torch.Tensor]:
    """Inverse of `shard`: checks that every rank is present, holds the same names, and agrees on replicated tensors."""
    per_stage, per_rank = _layout(config, tp, pp)
    absent = sorted(set((t, p) for p in range(pp) for t in range(tp)) - set(shards))
    if absent:
        raise ConversionError(f"missing shards for (tp_rank, pp_rank) {absent}")
    full, output_copy = {}, None
    for p in range(pp):
        ranks = [{k: v for k, v in shards[(t, p)].items() if not k.endswith("._extra_state")} for t in range(tp)]
        for t, sd in enumerate(ranks[1:], 1):
            if set(sd) != set(ranks[0]):
                diff = sorted(set(sd) ^ set(ranks[0]))
                raise ConversionError(
                    f"pipeline stage {p}: tensor-parallel ranks 0 and {t} hold different tensors: {diff}"
                )
        for local in ranks[0]:
            name = local
            if m := LAYER.match(local):
                name = f"decoder.layers.{p * per_stage + int(m.group(1))}.{m.group(2)}"
            kind = split_kind(local, config.gated_mlp)
            if kind == "expert":
                prefix, e, suffix = EXPERT.match(name).groups()
                for t in range(tp):
                    full[f"{prefix}{t * per_rank + int(e)}{suffix}"] = ranks[t][local]
            elif name == "output_layer.weight" and config.tie_word_embeddings and pp > 1:
                output_copy = _merge(name, [sd[local] for sd in ranks], kind)
            else:
                full[name] = _merge(name, [sd[local] for sd in ranks], kind)
    if config.tie_word_embeddings and pp > 1:
        embedding = full.get("embedding.word_embeddings.weight")
        if output_copy is None or embedding is None or not torch.equal(output_copy, embedding):
            raise ConversionError(
                "tied embeddings with PP > 1: the last stage's output_layer.weight must exist and equal the embedding"
            )
    return full


def to_megatron(state_dict: dict, config, *, tp: int = 1, pp: int = 1, make_vocab_size_divisible_by: int = 128):
    """Our state dict -> {(tp_rank, pp_rank): megatron-core GPTModel state dict} for a TP x PP layout."""
    from .plugin import check_megatron_compatible, padded_vocab_size

    check_megatron_compatible(config)
    padded = padded_vocab_size(config.vocab_size, tp, make_vocab_size_divisible_by)
    return shard(hf_to_mcore(state_dict, config, padded), config, tp=tp, pp=pp)


def from_megatron(shards: dict, config, *, tp: int, pp: int) -> dict[str, torch.Tensor]:
    """Inverse of `to_megatron`."""
    return mcore_to_hf(unshard(shards, config, tp=tp, pp=pp), config)


# ------------------------------------------------------------------------------------------- Megatron-LM files

TRACKER = "latest_checkpointed_iteration.txt"


def rank_dir(tp_rank: int, pp_rank: int, *, pp: int, ep: int) -> str:
    """Megatron-LM's `get_checkpoint_name` folder; with experts on the TP group the expert rank is the TP rank."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{tp_rank:03d}" if ep > 1 else "")


def checkpoint_args(config, *, tp: int, pp: int, make_vocab_size_divisible_by: int = 128) -> dict:
    """The `args` stored with the weights: what Megatron-LM's checkpoint checks and --use-checkpoint-args read."""
    from .plugin import megatron_lm_args, padded_vocab_size

    args = megatron_lm_args(config, tp=tp, pp=pp)
    args.setdefault("expert_model_parallel_size", 1)
    args.update(
        padded_vocab_size=padded_vocab_size(config.vocab_size, tp, make_vocab_size_divisible_by),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        ckpt_format="torch",
        seq_length=config.max_position_embeddings,
    )
    return args


def save_megatron_checkpoint(shards: dict, directory, args: dict, *, overwrite: bool = False) -> Path:
    """Write {(tp_rank, pp_rank): state dict} as a Megatron-LM "release" checkpoint, atomically."""
    target = Path(directory)
    tp, pp, ep = (
        args["tensor_model_parallel_size"],
        args["pipeline_model_parallel_size"],
        args["expert_model_parallel_size"],
    )
    if ep not in (1, tp):
        raise ConversionError(f"expert_model_parallel_size={ep}: only 1 or the TP size ({tp}, PPMoE) are written")
    with atomic_folder(target, overwrite=overwrite) as staging:
        for (t, p), sd in sorted(shards.items()):
            folder = staging / "release" / rank_dir(t, p, pp=pp, ep=ep)
            folder.mkdir(parents=True)
            record = {
                "args": argparse.Namespace(**args),
                "checkpoint_version": 3.0,
                "iteration": 0,
                "model": sd,
                "num_floating_point_operations_so_far": 0,
            }
            torch.save(record, folder / "model_optim_rng.pt")
        (staging / TRACKER).write_text("release")
    return target


def _load(path: Path, weights_only: bool) -> dict:
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as error:
        if weights_only and isinstance(error, pickle.UnpicklingError):
            raise ConversionError(
                f"{path} holds Python objects beyond tensors (Megatron-LM's saved args). If you trust the file, load "
                f"it with weights_only=False (--trust-checkpoint). Details: {str(error).splitlines()[0]}"
            ) from error
        if isinstance(error, (RuntimeError, EOFError, OSError, pickle.UnpicklingError)):  # torch.load on a damaged file
            raise ConversionError(
                f"{path} cannot be read, the file is truncated or damaged ({str(error).splitlines()[0]}); copy it "
                "again from where the checkpoint was saved."
            ) from error
        raise


def load_megatron_checkpoint(directory, *, weights_only: bool = True) -> tuple[dict, argparse.Namespace]:
    """Read a Megatron-LM legacy checkpoint (the tracker's iteration) -> ({(tp_rank, pp_rank): state dict}, args)."""
    root = Path(directory)
    if not (root / TRACKER).is_file():
        raise ConversionError(f"{root} is not a Megatron-LM checkpoint folder: no {TRACKER}")
    step = (root / TRACKER).read_text(errors="replace").strip()
    if step != "release" and not step.isdigit():
        raise ConversionError(
            f"{root / TRACKER} holds {step[:40]!r}; Megatron-LM writes 'release' or the iteration number there. Write "
            "the iteration of the checkpoint to convert (its iter_NNNNNNN folder) into it."
        )
    folder = root / ("release" if step == "release" else f"iter_{int(step):07d}")
    found = sorted(p.name for p in folder.glob("mp_rank_*")) if folder.is_dir() else []
    if not found:
        dist = folder.is_dir() and any((folder / n).exists() for n in (".metadata", "metadata.json"))
        raise ConversionError(
            f"{folder}: no mp_rank_* folders"
            + (" (a torch_dist checkpoint: save with --ckpt-format torch to convert it)" if dist else "")
        )
    first = _load(folder / found[0] / "model_optim_rng.pt", weights_only)
    args = first["args"]
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = getattr(args, "expert_model_parallel_size", 1)
    if ep not in (1, tp):
        raise ConversionError(f"expert_model_parallel_size={ep} with TP={tp}: only experts on the TP group are read")
    shards = {}
    for p in range(pp):
        for t in range(tp):
            path = folder / rank_dir(t, p, pp=pp, ep=ep) / "model_optim_rng.pt"
            if not path.is_file():
                raise ConversionError(f"missing {path.relative_to(root)} for TP={tp}, PP={pp}, EP={ep}")
            record = first if path.parent.name == found[0] else _load(path, weights_only)
            if "model" not in record:
                keys = ", ".join(k for k in record if k.startswith("model"))
                raise ConversionError(
                    f"{path}: no 'model' entry ({keys or 'none'}); virtual pipeline stages are not read"
                )
            shards[(t, p)] = record["model"]
    return shards, args


def _check_args(args, config, tp: int, pp: int) -> None:
    from .plugin import megatron_lm_args

    expected = megatron_lm_args(config, tp=tp, pp=pp)
    keys = (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "num_experts",
        "moe_ffn_hidden_size",
        "moe_router_topk",
        "moe_layer_freq",
        "add_bias_linear",
        "add_qkv_bias",
        "normalization",
        "untie_embeddings_and_output_weights",
        "position_embedding_type",
    )
    wrong = [
        f"{k}={getattr(args, k)!r} (config: {expected[k]!r})"
        for k in keys
        if k in expected and hasattr(args, k) and getattr(args, k) != expected[k]
    ]
    if wrong:
        raise ConversionError("the Megatron checkpoint was saved for another model: " + ", ".join(wrong))


def convert_hf_to_megatron(
    hf_path, out, *, tp: int = 1, pp: int = 1, make_vocab_size_divisible_by: int = 128, overwrite: bool = False
) -> Path:
    """A saved GPTMoEForCausalLM folder -> a Megatron-LM release checkpoint for TP x PP (experts on the TP group)."""
    from ..modeling import GPTMoEForCausalLM

    model = GPTMoEForCausalLM.from_pretrained(hf_path)
    shards = to_megatron(
        model.state_dict(), model.config, tp=tp, pp=pp, make_vocab_size_divisible_by=make_vocab_size_divisible_by
    )
    args = checkpoint_args(model.config, tp=tp, pp=pp, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    return save_megatron_checkpoint(shards, out, args, overwrite=overwrite)


def convert_megatron_to_hf(megatron_path, out, config, *, weights_only: bool = True):
    """A Megatron-LM legacy checkpoint of our model -> a GPTMoEForCausalLM folder. `config`: a GPTMoEConfig, or a
    folder / config.json it is read from (Megatron checkpoints do not carry it)."""
    from ..modeling import GPTMoEConfig, GPTMoEForCausalLM

    if not isinstance(config, GPTMoEConfig):
        config = GPTMoEConfig.from_pretrained(config)
    shards, args = load_megatron_checkpoint(megatron_path, weights_only=weights_only)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _check_args(args, config, tp, pp)
    state_dict = from_megatron(shards, config, tp=tp, pp=pp)
    model = GPTMoEForCausalLM(config)
    model.load_state_dict(state_dict, strict=True)
    model.to(state_dict["model.embed_tokens.weight"].dtype).save_pretrained(out)
    return model
