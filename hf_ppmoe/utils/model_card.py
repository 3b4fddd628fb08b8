"""Model cards (README.md) for every folder hf_ppmoe writes, built with huggingface_hub's `ModelCard`.

The metadata says what the Hub needs to list and load the model: `library_name` (transformers), tags
(`mixture-of-experts`, the gate, `hf_ppmoe`), `base_model` and `base_model_relation` when the model comes from
another Hub model, datasets where known, and training's evaluation results as a model-index. The text gives total
and active parameters, the MoE settings and how to load the model with and without hf_ppmoe installed.

Relations use the Hub's vocabulary (adapter, merge, quantized, finetune): a merge of experts into one FFN is a
"merge" (weights of several networks averaged into one); upcycling, importing, exporting and training are full-weight
derivatives at the source's precision with no separate adapter, which the Hub lists as "finetune".

A README.md that the source folder already had is not overwritten silently: the new card keeps its metadata where
ours has none (license, language, ...) and quotes its text under "Card of the source model".
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from huggingface_hub import EvalResult, ModelCard, ModelCardData

CARD_FILE = "README.md"
RELATIONS = {"upcycle": "finetune", "import": "finetune", "export": "finetune", "merge": "merge", "train": "finetune"}
_DOING = {
    "upcycle": "upcycled (its dense FFNs copied into experts) from",
    "import": "imported into hf_ppmoe's classes from",
    "export": "exported from hf_ppmoe's classes to Transformers' own class, from",
    "merge": "merged back into a dense model (experts averaged) from",
    "train": "trained with `python -m hf_ppmoe.training` from",
}
_MOE_FIELDS = (
    "num_experts", "num_experts_per_tok", "router_type", "capacity_factor", "eval_capacity_factor", "moe_layer_frequency",
    "moe_layers", "encoder_moe_layers", "decoder_moe_layers", "encoder_moe_layer_frequency", "decoder_moe_layer_frequency",
    "router_aux_loss_coef", "router_z_loss_coef", "shared_expert_intermediate_size",
)
_KEPT_HEADING = "## Card of the source model (its README.md, kept)"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def hub_id(name) -> str | None:
    """`name` when it is a Hub repository id ("org/model") and not a local path, else None."""
    name = str(name or "")
    return name if _HUB_ID.match(name) and not os.path.exists(name) else None


def count_parameters(config, model_class=None) -> tuple[int, int]:
    """(total, active per token) of `model_class(config)` (by default the Auto class of the config's family), built
    on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    with torch.device("meta"):
        if model_class is None:
            auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
            model = auto.from_config(config)
        else:
            model = model_class(config)
    total = model.num_parameters()
    active = model.num_active_parameters() if hasattr(model, "num_active_parameters") else total
    return total, active


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M ({n:,})" if n >= 1e5 else f"{n:,}"


def _is_ours(config) -> bool:
    return config.model_type in ("gpt_moe", "seq2seq_moe")


def _loading(config, repo: str) -> str:
    seq2seq = getattr(config, "is_encoder_decoder", False)
    auto = "AutoModelForSeq2SeqLM" if seq2seq else "AutoModelForCausalLM"
    head = f"from transformers import AutoTokenizer, {auto}\n"
    if not _is_ours(config):
        return (
            f"A plain Transformers `{config.model_type}` model: no hf_ppmoe needed.\n\n```python\n{head}"
            f'model = {auto}.from_pretrained("{repo}")\ntokenizer = AutoTokenizer.from_pretrained("{repo}")\n```\n'
        )
    return (
        "With hf_ppmoe installed, which registers the classes with the Auto classes (it is not on PyPI yet: clone its "
        "repository and run `pip install -e .` in the clone):\n\n"
        f'```python\nimport hf_ppmoe\n{head}\nmodel = {auto}.from_pretrained("{repo}")\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{repo}")\n```\n\n'
        "Without it, nothing to install: the folder carries the model's code, which Transformers runs when asked to:\n\n"
        f'```python\n{head}\nmodel = {auto}.from_pretrained("{repo}", trust_remote_code=True)\n```\n\n'
        "GShard's flat beam search: `model.generate(**inputs, num_beams=4, custom_generate=hf_ppmoe.generation."
        f'flat_beam_search)`, or without hf_ppmoe `custom_generate="{repo}", trust_remote_code=True` (the folder '
        "carries it).\n"
    )


def build_card(
    config,
    *,
    parameters: tuple[int, int],
    conversion: str | None = None,
    source=None,
    moe_config=None,
    datasets: list[str] | None = None,
    evaluation: dict[str, float] | None = None,
    evaluation_dataset: str = "held-out split",
    source_card: Path | None = None,
    name: str = "model",
) -> ModelCard:
    """The card of a model with `config`. parameters: (total, active); conversion: how it was made (a key of
    RELATIONS); source: the folder, Hub id or model it was made from; moe_config: where the MoE settings are read
    when `config` is not ours (an export's source); evaluation: metric name -> value from training (eval/loss, ...);
    source_card: the source folder's README.md, kept in the new card."""
    moe_config = moe_config if moe_config is not None else config
    base = hub_id(source) or hub_id(getattr(getattr(source, "config", None), "name_or_path", None))
    moe = {f: getattr(moe_config, f) for f in _MOE_FIELDS if getattr(moe_config, f, None) is not None}
    is_moe = conversion != "merge" and "num_experts" in moe
    tags = ["hf_ppmoe"] + (["mixture-of-experts", f"gate-{moe['router_type']}"] if is_moe and "router_type" in moe else [])
    tags += [config.model_type]
    seq2seq = getattr(config, "is_encoder_decoder", False)
    kept = ModelCard.load(source_card) if source_card is not None else None
    metadata = dict(kept.data.to_dict()) if kept is not None else {}
    for key in ("base_model", "base_model_relation", "model-index", "eval_results", "library_name", "tags", "pipeline_tag",
                "model_name", "datasets", "metrics"):
        metadata.pop(key, None)
    kept_text, kept_tags = (kept.text.strip(), kept.data.tags or []) if kept is not None else ("", [])
    if "hf_ppmoe" in kept_tags:  # our own card: only the card it kept goes on
        kept_text, kept_tags = kept_text.partition(_KEPT_HEADING)[2].strip(), []
    eval_results = None
    if evaluation:
        task = "text2text-generation" if seq2seq else "text-generation"
        eval_results = [
            EvalResult(task_type=task, dataset_type=(datasets or ["custom"])[0], dataset_name=evaluation_dataset,
                       metric_type=metric.split("/")[-1], metric_value=round(float(value), 4))
            for metric, value in evaluation.items()
        ]
    data = ModelCardData(
        **metadata,
        library_name="transformers",
        pipeline_tag="text2text-generation" if seq2seq else "text-generation",
        tags=tags + [t for t in kept_tags if t not in tags],
        base_model=base,
        base_model_relation=RELATIONS[conversion] if base and conversion else None,
        datasets=datasets or (kept.data.datasets if kept is not None else None),
        model_name=name,
        eval_results=eval_results,
    )
    total, active = parameters
    lines = [f"# {name}", ""]
    origin = base or (Path(str(source)).name if isinstance(source, (str, os.PathLike)) else None)
    if conversion:
        lines += [f"This model was {_DOING[conversion]} " + (f"[{base}](https://huggingface.co/{base})." if base else
                  f"`{origin}`." if origin else "a model built from scratch."), ""]
    lines += ["## Model", "", "| | |", "|---|---|", f"| class | `{config.architectures[0] if config.architectures else config.model_type}` |",
              f"| total parameters | {_count(total)} |",
              f"| active parameters per token | {_count(active)} |"]
    if is_moe:
        lines += [f"| `{k}` | `{v}` |" for k, v in moe.items()]
        lines += ["| capacity | dropless (every routed token reaches its experts) |"] if "capacity_factor" not in moe else []
    lines += [""]
    if evaluation:
        lines += ["## Evaluation", "", f"On the {evaluation_dataset}:", "", "| metric | value |", "|---|---|"]
        lines += [f"| {metric} | {value:.4f} |" for metric, value in evaluation.items()] + [""]
    lines += ["## How to load it", "", _loading(config, name)]
    if kept_text:
        lines += [_KEPT_HEADING, "", kept_text, ""]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))


def write_card(folder: str | os.PathLike, card: ModelCard) -> Path:
    """Write `card` as folder/README.md, replacing any earlier one in one step (a temporary file renamed)."""
    path = Path(folder) / CARD_FILE
    temporary = path.with_name(f".{CARD_FILE}.{os.getpid()}.tmp")
    temporary.write_text(str(card), encoding="utf-8")
    with open(temporary, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temporary, path)
    return path


def conversion_card(conversion: str, config, model_class, checkpoint, folder: Path, name: str) -> ModelCard:
    """The card of a converter's output, being written in `folder` (the source's README.md, carried into it, is kept
    inside); name: the output's name."""
    if _is_ours(config) or conversion == "merge":
        parameters, moe_config = count_parameters(config, model_class), None
    else:  # an export: the same model in another class; the MoE settings and counts are the source's
        moe_config = checkpoint.config
        parameters = count_parameters(moe_config)
    source = checkpoint.source if checkpoint.model is None else checkpoint.model
    carried = folder / CARD_FILE
    return build_card(config, parameters=parameters, conversion=conversion, source=source, moe_config=moe_config,
                      source_card=carried if carried.is_file() else None, name=name)


def training_card(model, *, name: str, source=None, datasets=None, evaluation=None, evaluation_dataset="held-out split") -> ModelCard:
    """The card of a training output: `model` as trained, `source` the model or folder it started from (None: from
    scratch), evaluation: the final evaluation metrics."""
    total = model.num_parameters()
    active = model.num_active_parameters() if hasattr(model, "num_active_parameters") else total
    folder = Path(source) if isinstance(source, (str, os.PathLike)) and os.path.isdir(source) else None
    kept = folder / CARD_FILE if folder is not None and (folder / CARD_FILE).is_file() else None
    return build_card(model.config, parameters=(total, active), conversion="train", source=source,
                      datasets=[d for d in datasets or [] if hub_id(d)], evaluation=evaluation,
                      evaluation_dataset=evaluation_dataset, source_card=kept, name=name)
