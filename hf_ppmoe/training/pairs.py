"""(source, target) pairs for Seq2Seq-MoE: reading, tokenizing, batching, and generation metrics.

- `read_pairs` reads jsonl / json / csv / parquet files, a `save_to_disk` folder or a dataset name through `datasets`,
  as two columns (`--source_column` / `--target_column`) or translation records (`{"translation": {"de": ..,
  "en": ..}}` with `--source_lang` / `--target_lang`), into a Dataset of `source` and `target` strings.
- `PairData` tokenizes them once (`Dataset.map`, EOS appended to both sides as T5 does) and serves the training loop:
  `batch(step, micro)` is this process's micro-batch of an optimizer step, a pure function of (seed, step) like the
  causal-LM data, so its state is only the seed and resuming needs nothing else; `validation_batches()` its share of
  the validation pairs. A batch holds input_ids, attention_mask, labels (-100 where padded) and num_items_in_batch:
  the label tokens of the whole optimizer step (every micro-step of every data-parallel process) divided by their
  count, so the loss each process back-propagates, averaged over micro-steps and processes, is the token-weighted
  mean of the global batch; any split of that batch over processes trains the same model.
- `generation_metrics` generates for the validation sources with GShard flat beam search and scores the outputs
  against the targets with sacrebleu (chrF and BLEU); `generate_and_score` does it for a finished training run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..modeling.loss import IGNORE_INDEX
from .block_data import batch_rows

_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def read_pairs(
    paths: list[str] | None = None,
    dataset_name: str | None = None,
    *,
    split: str = "train",
    config_name: str | None = None,
    source_column: str = "source",
    target_column: str = "target",
    source_lang: str | None = None,
    target_lang: str | None = None,
):
    """A `datasets.Dataset` of `source` and `target` strings from files or a dataset (see the module docstring)."""
    import datasets

    if paths:
        kinds = {_FORMATS.get(Path(p).suffix.lower()) for p in paths}
        if None in kinds or len(kinds) > 1:
            raise ValueError(f"Pair files must all be one of {', '.join(_FORMATS)} (got {', '.join(paths)}).")
        data = datasets.load_dataset(kinds.pop(), data_files=list(paths), split="train")
        where = ", ".join(paths)
    elif dataset_name and Path(dataset_name).is_dir():
        data = datasets.load_from_disk(dataset_name)
        data, where = (data[split] if isinstance(data, datasets.DatasetDict) else data), dataset_name
    else:
        data, where = datasets.load_dataset(dataset_name, config_name, split=split), dataset_name
    if source_lang or target_lang:
        if not (source_lang and target_lang) or "translation" not in data.column_names:
            raise ValueError(f"--source_lang/--target_lang read translation records ({{'translation': {{'de': ..., "
                             f"'en': ...}}}}): give both, for data with a 'translation' column ({where} has "
                             f"{data.column_names}).")
        languages = set(data.features["translation"].keys()) if hasattr(data.features["translation"], "keys") else set()
        absent = [lang for lang in (source_lang, target_lang) if languages and lang not in languages]
        if absent:
            raise ValueError(f"{where}: the translation records have no {absent} (languages: {sorted(languages)}).")
        return data.map(lambda r: {"source": r["translation"][source_lang], "target": r["translation"][target_lang]},
                        remove_columns=data.column_names)
    absent = [c for c in (source_column, target_column) if c not in data.column_names]
    if absent:
        raise ValueError(f"{where} has no column {absent[0]!r} (columns: {data.column_names}); set --source_column and "
                         "--target_column, or --source_lang/--target_lang for translation records.")
    data = data.select_columns([source_column, target_column])
    return data.rename_columns({source_column: "source", target_column: "target"}) if (source_column, target_column) != (
        "source", "target") else data


def tokenize_pairs(pairs, tokenizer, max_source_length: int, max_target_length: int):
    """input_ids and labels (each truncated, then ended by EOS) of every pair, computed once with `Dataset.map`."""
    eos = tokenizer.eos_token_id

    def encode(rows):
        sources = tokenizer(rows["source"], add_special_tokens=False)["input_ids"]
        targets = tokenizer(rows["target"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [s[: max_source_length - 1] + [eos] for s in sources],
                "labels": [t[: max_target_length - 1] + [eos] for t in targets]}

    return pairs.map(encode, batched=True, remove_columns=pairs.column_names)


def collate(rows: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Pad a list of tokenized pairs: input_ids with the pad id (attention_mask 0 there), labels with IGNORE_INDEX."""
    n, m = max(len(r["input_ids"]) for r in rows), max(len(r["labels"]) for r in rows)
    input_ids = torch.full((len(rows), n), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), m), IGNORE_INDEX, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
        labels[i, : len(row["labels"])] = torch.tensor(row["labels"])
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        attention_mask[i, : len(row["input_ids"])] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class PairData:
    """Training and validation pairs, tokenized, served by (optimizer step, micro-step) to one data-parallel process
    (see the module docstring); the interface of `block_data.py`."""

    def __init__(self, train, validation, args, pad_token_id: int, rank: int = 0, world: int = 1):
        if len(train) == 0:
            raise ValueError("The training data has no pairs.")
        self.train, self.validation, self.args, self.pad, self.rank, self.world = train, validation, args, pad_token_id, rank, world
        self._label_lengths = torch.tensor([len(labels) for labels in train["labels"]])
        self.tokens_per_row = sum(map(len, train["input_ids"])) / len(train) + float(self._label_lengths.float().mean())
        digest = hashlib.sha256()
        for column in ("input_ids", "labels"):
            for chunk in train.data.table.column(column).chunks:
                digest.update(chunk.offsets.to_numpy().tobytes() + chunk.flatten().to_numpy().tobytes())
        self.fingerprint = digest.hexdigest()

    def __str__(self) -> str:
        return (f"{len(self.train)} training pairs (source + target: {self.tokens_per_row:.0f} tokens on average), "
                f"{len(self.validation)} held out")

    def _rows(self, step: int, micro: int, rank: int) -> torch.Tensor:
        a = self.args
        return batch_rows(step, micro, rank, self.world, a.per_device_train_batch_size, a.gradient_accumulation_steps,
                          a.seed, len(self.train))

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        a = self.args
        everyone = [self._rows(step, m, r) for m in range(a.gradient_accumulation_steps) for r in range(self.world)]
        tokens = self._label_lengths[torch.cat(everyone)].sum()
        batch = collate(self.train.select(self._rows(step, micro, self.rank).tolist()), self.pad)
        batch["num_items_in_batch"] = tokens / (a.gradient_accumulation_steps * self.world)
        return batch

    def validation_batches(self) -> list[dict[str, torch.Tensor]]:
        """This process's share of the validation batches (every world-th, from its rank)."""
        b, n = self.args.per_device_train_batch_size, len(self.validation)
        starts = list(range(0, n, b))
        starts = starts[: self.args.eval_batches] if self.args.eval_batches else starts
        return [collate(self.validation.select(range(i, min(i + b, n))), self.pad) for i in starts[self.rank :: self.world]]

    def state_dict(self) -> dict:
        return {}  # the batches are a pure function of the seed and the step

    def load_state_dict(self, state: dict) -> None:
        pass


def load_pairs(args):
    """(training pairs, validation pairs) of a run: its files or dataset, or the built-in standard-library task.
    Without validation files, every 20th training pair is held out."""
    import datasets

    from .stdlib_task import stdlib_pairs

    columns = dict(source_column=args.source_column, target_column=args.target_column, source_lang=args.source_lang,
                   target_lang=args.target_lang)
    if args.train_file or args.dataset_name:
        train = read_pairs(args.train_file, args.dataset_name, split=args.dataset_split, config_name=args.dataset_config_name,
                           **columns)
    else:
        train, validation = stdlib_pairs()
        return (datasets.Dataset.from_list([{"source": p["source"], "target": p["target"]} for p in rows])
                for rows in (train, validation))
    if args.validation_file:
        return train, read_pairs(args.validation_file, **columns)
    held_out = [i for i in range(len(train)) if i % 20 == 19]
    return train.select(sorted(set(range(len(train))) - set(held_out))), train.select(held_out)


def pair_data(args, tokenizer, train, validation, dp) -> PairData:
    def tokens(pairs):
        return tokenize_pairs(pairs, tokenizer, args.max_source_length, args.max_target_length)

    data = PairData(tokens(train), tokens(validation), args, tokenizer.pad_token_id, dp.rank, dp.size)
    data.validation_pairs = validation  # the texts, for generation metrics
    return data


@torch.no_grad()
def generation_metrics(model, tokenizer, pairs, *, num_beams: int = 4, max_new_tokens: int = 48, batch_size: int = 16,
                       max_source_length: int = 256) -> tuple[dict[str, float], list[str]]:
    """chrF and BLEU (sacrebleu) of the model's flat-beam-search outputs for `pairs` (a Dataset or list of
    {"source", "target"}) against their targets; returns the metrics and the generated texts."""
    import sacrebleu

    from ..generation import flat_beam_search

    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    sources, targets = [p["source"] for p in pairs], [p["target"] for p in pairs]
    outputs = []
    eos = tokenizer.eos_token_id
    for i in range(0, len(sources), batch_size):
        ids = [s[: max_source_length - 1] + [eos] for s in tokenizer(sources[i : i + batch_size], add_special_tokens=False)["input_ids"]]
        batch = collate([{"input_ids": x, "labels": [eos]} for x in ids], tokenizer.pad_token_id)
        generated = model.generate(
            input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
            custom_generate=flat_beam_search, num_beams=num_beams, max_new_tokens=max_new_tokens, do_sample=False,
            early_stopping=True,
        )
        outputs += tokenizer.batch_decode(generated, skip_special_tokens=True)
    model.train(was_training)
    outputs = [o.strip() for o in outputs]
    chrf = sacrebleu.corpus_chrf(outputs, [targets]).score
    bleu = sacrebleu.corpus_bleu(outputs, [targets]).score
    return {"eval/chrf": chrf, "eval/bleu": bleu}, outputs


def generate_and_score(model, run) -> dict:
    """chrF and BLEU of the final model's outputs (GShard flat beam search) for the first generation_eval_pairs
    validation pairs of train.py's `run`, and a few of them as samples (logs/samples.jsonl)."""
    args, pairs = run.args, run.data.validation_pairs
    pairs = pairs.select(range(min(args.generation_eval_pairs or len(pairs), len(pairs))))
    scores, outputs = generation_metrics(model, run.tokenizer, pairs, num_beams=args.generation_num_beams,
                                         max_new_tokens=args.max_target_length, max_source_length=args.max_source_length,
                                         batch_size=args.per_device_train_batch_size)
    with open(Path(args.output_dir, "logs", "samples.jsonl"), "w") as f:
        for pair, output in list(zip(pairs, outputs))[:8]:
            f.write(json.dumps({"source": pair["source"], "target": pair["target"], "generated": output}) + "\n")
    return scores
