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
  against the targets with sacrebleu (chrF and BLEU).
"""

from __future__ import annotations

from pathlib import Path

import torch

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
    """Pad a list of tokenized pairs: input_ids with the pad id (attention_mask 0 there), labels with -100."""
    n, m = max(len(r["input_ids"]) for r in rows), max(len(r["labels"]) for r in rows)
    input_ids = torch.full((len(rows), n), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), m), -100, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
        labels[i, : len(row["labels"])] = torch.tensor(row["labels"])
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        attention_mask[i, : len(row["input_ids"])] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class PairData:
    """Training and validation pairs, tokenized, served by (optimizer step, micro-step) to one data-parallel process
    (see the module docstring)."""

    def __init__(self, train, validation, *, pad_token_id: int, batch_size: int, accumulation: int, seed: int,
                 rank: int = 0, world: int = 1, eval_batches: int = 0):
        if len(train) == 0:
            raise ValueError("The training data has no pairs.")
        self.train, self.validation, self.pad = train, validation, pad_token_id
        self.batch_size, self.accumulation, self.seed, self.rank, self.world = batch_size, accumulation, seed, rank, world
        self.eval_batches = eval_batches
        self._label_lengths = torch.tensor([len(labels) for labels in train["labels"]])

    def rows(self, step: int, micro: int, rank: int) -> torch.Tensor:
        """Indices of the training pairs of (step, micro-step, data-parallel process): consecutive slices of seeded
        permutations, one per epoch."""
        b, n = self.batch_size, len(self.train)
        start = ((step * self.accumulation + micro) * self.world + rank) * b
        positions = torch.arange(start, start + b)
        epochs, offsets = positions // n, positions % n
        rows = torch.empty(b, dtype=torch.long)
        for epoch in range(start // n, (start + b - 1) // n + 1):
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
            rows[epochs == epoch] = perm[offsets[epochs == epoch]]
        return rows

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        everyone = [self.rows(step, m, r) for m in range(self.accumulation) for r in range(self.world)]
        tokens = self._label_lengths[torch.cat(everyone)].sum()
        batch = collate(self.train.select(self.rows(step, micro, self.rank).tolist()), self.pad)
        batch["num_items_in_batch"] = tokens / (self.accumulation * self.world)
        return batch

    def validation_batches(self) -> list[dict[str, torch.Tensor]]:
        """This process's share of the validation batches (every world-th, from its rank)."""
        starts = list(range(0, len(self.validation), self.batch_size))
        starts = starts[: self.eval_batches] if self.eval_batches else starts
        return [collate(self.validation.select(range(i, min(i + self.batch_size, len(self.validation)))), self.pad)
                for i in starts[self.rank :: self.world]]

    def state_dict(self) -> dict:
        return {"seed": self.seed, "pairs": len(self.train)}

    def load_state_dict(self, state: dict) -> None:
        if state != self.state_dict():
            raise ValueError(f"The checkpoint's data ({state}) is not this run's ({self.state_dict()}): resume with the "
                             "same pairs and --seed.")


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
            early_stopping=True, no_repeat_ngram_size=3,
        )
        outputs += tokenizer.batch_decode(generated, skip_special_tokens=True)
    model.train(was_training)
    outputs = [o.strip() for o in outputs]
    chrf = sacrebleu.corpus_chrf(outputs, [targets]).score
    bleu = sacrebleu.corpus_bleu(outputs, [targets]).score
    return {"eval/chrf": chrf, "eval/bleu": bleu}, outputs
