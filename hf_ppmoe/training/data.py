"""Text data: the built-in corpus, a tokenizer trained on it, and the documents of a training source as a `datasets`
stream, with bad data named by file and line.

The built-in corpus is the Python language reference that every CPython installation ships as
`pydoc_data.topics` (~460 KB of English prose and code), so the demo and the tests need no download.

A source is data files (.txt: a document per file, paragraph or line, `SAMPLE_BY`; .jsonl / .json; .csv; .parquet;
globs of shards), a folder written by `Dataset.save_to_disk`, a dataset name in the local `datasets` cache, or the
built-in corpus. `documents` reads any of them as a `datasets.IterableDataset`; nothing runs code from the data
(`datasets` no longer runs loading scripts). Tokenizing and packing into blocks is in `block_data.py`. The module
imports torch and the tokenizer libraries when it tokenizes: the command checks its flags with it first.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import itertools
import json
import os
from pathlib import Path

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>"]
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
# what a document of a .txt file is (the names of `datasets`' text loader): the whole file (the default, right for code
# and prose alike: a blank line inside a function or a chapter does not end it), a block of lines between blank lines,
# or one line
SAMPLE_BY = ("document", "paragraph", "line")


def builtin_corpus() -> list[str]:
    """The documents of the built-in corpus (one per language-reference topic, in a fixed order)."""
    from pydoc_data.topics import topics

    return [topics[key].strip() for key in sorted(topics)]


def train_tokenizer(texts, vocab_size: int = 2048):
    """A byte-level BPE tokenizer (GPT-2 style), trained on `texts` (any iterable of strings: a corpus of your own)
    in seconds and offline: a Transformers `PreTrainedTokenizerFast` with pad `<|pad|>` and BOS = EOS
    `<|endoftext|>`, ready for `save_pretrained` beside a model of your own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|pad|>", eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )


def pack(texts: list[str], tokenizer, block_size: int):
    """Tokenize, join documents with EOS and cut into `[N, block_size]` blocks (the remainder is dropped): in memory,
    for small lists of texts (the demo's held-out set); training data goes through `block_data.py`, which packs alike."""
    import torch

    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // block_size
    if n == 0:
        raise ValueError(f"The corpus has {len(ids)} tokens, fewer than one block of block_size={block_size}.")
    return torch.tensor(ids[: n * block_size]).view(n, block_size)


def data_files(patterns: list[str]) -> list[str]:
    """The files that paths and globs name (a glob's matches sorted), all of one kind (.txt, .jsonl/.json, .csv or
    .parquet). Raises ValueError naming the path and the fix."""
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise ValueError(f"Data file pattern {pattern} matches no file.")
        for path in matches:
            if not Path(path).is_file():
                raise ValueError(f"Data file {path} does not exist.")
            if Path(path).suffix not in BUILDERS:
                raise ValueError(
                    f"Data file {path}: use .txt (--sample_by: a document per file, paragraph or line), .jsonl / .json, "
                    ".csv or .parquet, or a folder written by Dataset.save_to_disk (--dataset_name)."
                )
        files.extend(matches)
    kinds = {BUILDERS[Path(f).suffix] for f in files}
    if len(kinds) > 1:
        raise ValueError(f"Data files of different kinds ({', '.join(sorted(kinds))}) in one source; convert them to one kind.")
    return files


class Source:
    """Where documents come from: `files` (paths, globs expanded; `sample_by`: what a document of a .txt file is, one of
    `SAMPLE_BY`), a `save_to_disk` folder or dataset name, or the built-in corpus (neither given)."""

    def __init__(self, files: list[str] | None = None, dataset_name: str | None = None, config_name: str | None = None,
                 split: str = "train", text_column: str = "text", sample_by: str = SAMPLE_BY[0]):
        if sample_by not in SAMPLE_BY:
            raise ValueError(f"--sample_by {sample_by}: use one of {', '.join(SAMPLE_BY)}.")
        self.files = data_files(files) if files else None
        self.dataset_name, self.config_name, self.split, self.text_column = dataset_name, config_name, split, text_column
        self.sample_by = sample_by

    @classmethod
    def of(cls, args, validation: bool = False) -> Source | None:
        """The training source (`validation`: the --validation_file source, None without one) of a run's arguments."""
        if validation:
            return cls(args.validation_file, text_column=args.text_column, sample_by=args.sample_by) if args.validation_file else None
        return cls(args.train_file, args.dataset_name, args.dataset_config_name, args.dataset_split, args.text_column,
                   args.sample_by)

    def __str__(self) -> str:
        if self.files:
            return ", ".join(self.files) if len(self.files) <= 3 else f"{self.files[0]} and {len(self.files) - 1} more files"
        return self.dataset_name or "the built-in corpus"

    def dataset(self, streaming: bool = True):
        """A `datasets.IterableDataset` of the source's records: .txt and .jsonl files read line by line (each file a
        shard; a bad line is named as it is read), .json / .csv / .parquet by `datasets`' builders, a dataset over its
        memory-mapped Arrow files (or streamed from the Hub with `streaming`)."""
        import datasets

        if self.files:
            builder = BUILDERS[Path(self.files[0]).suffix]
            if Path(self.files[0]).suffix in (".txt", ".jsonl"):
                reader = TEXT_READERS[self.sample_by] if builder == "text" else _json_lines
                return datasets.IterableDataset.from_generator(
                    reader, gen_kwargs={"files": self.files, "text_column": self.text_column}
                )
            return datasets.load_dataset(builder, data_files=self.files, split="train", streaming=True)
        if self.dataset_name is None:
            return datasets.Dataset.from_dict({"text": builtin_corpus()}).to_iterable_dataset()
        if Path(self.dataset_name).is_dir():
            data = datasets.load_from_disk(self.dataset_name)
            data = data[self.split] if isinstance(data, datasets.DatasetDict) else data
        else:
            data = datasets.load_dataset(self.dataset_name, self.config_name, split=self.split, streaming=streaming)
        if isinstance(data, datasets.Dataset):
            if self.text_column not in data.column_names:
                raise ValueError(f"Dataset {self.dataset_name} has no column {self.text_column!r} (columns: {data.column_names}); set --text_column.")
            data = data.to_iterable_dataset(num_shards=min(len(data), 64) or 1)
        return data

    def key(self, streaming: bool = False) -> dict:
        """What the source's documents are, for cache keys and run records: the files' paths, sizes and modification
        times; a dataset's fingerprint (streamed from the Hub: its name, configuration and split); or the built-in
        corpus' hash."""
        import datasets

        if self.files:
            stats = [(os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in self.files]
            text = {"sample_by": self.sample_by} if BUILDERS[Path(self.files[0]).suffix] == "text" else {}
            return {"files": stats, "text_column": self.text_column, **text}
        if self.dataset_name is None:
            return {"builtin": hashlib.sha256("\0".join(builtin_corpus()).encode()).hexdigest()}
        if Path(self.dataset_name).is_dir():
            data = datasets.load_from_disk(self.dataset_name)
            data = data[self.split] if isinstance(data, datasets.DatasetDict) else data
        elif streaming:
            return {"dataset": [self.dataset_name, self.config_name, self.split], "text_column": self.text_column}
        else:
            data = datasets.load_dataset(self.dataset_name, self.config_name, split=self.split)
        return {"dataset": data._fingerprint, "text_column": self.text_column}

    def texts(self, streaming: bool = True, batch_size: int = 256):
        """Lists of up to `batch_size` document texts, in order. Errors in the data are raised as one ValueError
        naming the file, line or row, and the fix."""
        return self.batches(self.dataset(streaming), batch_size)

    def batches(self, data, batch_size: int):
        """Lists of document texts from `data` (this source's `dataset()`, perhaps split or resumed)."""
        batch: list[str] = []
        try:
            for record in data:
                text = record.get(self.text_column)
                if not isinstance(text, str):
                    raise ValueError(
                        f"{self} has a record whose {self.text_column!r} column is missing or not text "
                        f"({str(record)[:100]}); set --text_column."
                    )
                if text:
                    batch.append(text)
                if len(batch) == batch_size:
                    yield batch
                    batch = []
        except DataError:
            raise
        except Exception as error:  # the builders' errors (pyarrow, csv, decoding): named by file and line if they can be
            if problem := self.diagnose():
                raise problem from error
            raise
        if batch:
            yield batch

    def diagnose(self) -> DataError | None:
        """The first problem in the source's files, naming the file (and line or row) and the fix."""
        for path in self.files or []:
            if problem := check_file(path, self.text_column):
                return DataError(problem)
        return None


class DataError(ValueError):
    """Bad data: the message names the file, line or row, and the fix."""


def _decoded(path: str):
    """(line number, line) of a UTF-8 text file."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(
                    f"{path}:{number} is not UTF-8 text (byte {error.start}: {raw[error.start:error.start + 1]!r}); "
                    "training files are UTF-8 text. Convert the file (e.g. iconv -t utf-8), or point --train_file at the text."
                ) from None


def _trimmed(text: str) -> str:
    """A document without the blank lines and line ends around it; the first line keeps its indentation (code)."""
    lines = text.rstrip().splitlines(keepends=True)
    while lines and not lines[0].strip():
        lines.pop(0)
    return "".join(lines)


def _documents(files: list[str], text_column: str):
    """Documents of .txt files (--sample_by document): each file, whole."""
    for path in files:
        if text := _trimmed("".join(line for _, line in _decoded(path))):
            yield {text_column: text}


def _paragraphs(files: list[str], text_column: str):
    """Documents of .txt files (--sample_by paragraph): blocks of lines separated by blank lines."""
    for path in files:
        lines: list[str] = []
        for _, line in itertools.chain(_decoded(path), [(0, "\n")]):
            if line not in ("\n", "\r\n"):
                lines.append(line)
            elif text := _trimmed("".join(lines)):
                yield {text_column: text}
                lines = []


def _lines(files: list[str], text_column: str):
    """Documents of .txt files (--sample_by line): every non-empty line."""
    for path in files:
        for _, line in _decoded(path):
            if text := _trimmed(line):
                yield {text_column: text}


TEXT_READERS = {"document": _documents, "paragraph": _paragraphs, "line": _lines}


def _json_lines(files: list[str], text_column: str):
    """Documents of .jsonl files: one JSON object per line, its text field."""
    for path in files:
        for number, line in _decoded(path):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise DataError(
                    f"{path}:{number} is not a JSON line ({error}): a .jsonl file holds one JSON object per line "
                    "(a torn or unfinished line: repair or remove it)."
                ) from None
            if problem := _record_problem(record, text_column):
                raise DataError(f"{path}:{number}{problem}")
            yield {text_column: record[text_column]}


def _record_problem(record, text_column: str) -> str | None:
    if not isinstance(record, dict):
        return f" is a JSON {type(record).__name__}, not an object with a {text_column!r} field."
    if text_column not in record:
        return f" has no {text_column!r} field (fields: {sorted(record)}); set --text_column."
    if not isinstance(record[text_column], str):
        return f": the {text_column!r} field is {record[text_column]!r}, not text; fill or drop that record."
    return None


def check_file(path: str, text_column: str = "text") -> str | None:
    """The first problem in a .json, .csv or .parquet file (not UTF-8, not JSON, a missing or non-text column), or
    None. Reads the file through; called when `datasets` failed to read it."""
    suffix = Path(path).suffix
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
        if text_column not in names:
            return f"{path} has no column {text_column!r} (columns: {names}); set --text_column."
        values = pq.read_table(path, columns=[text_column]).column(0).to_pylist()
        return next((f"{path} row {i}: the {text_column!r} column is {v!r}, not text; fill or drop that row."
                     for i, v in enumerate(values) if not isinstance(v, str)), None)
    try:
        content = "".join(line for _, line in _decoded(path))
    except DataError as error:
        return str(error)
    if suffix == ".csv":
        reader = csv.DictReader(content.splitlines())
        if text_column not in (reader.fieldnames or []):
            return f"{path} has no column {text_column!r} (header: {reader.fieldnames}); set --text_column."
        return next((f"{path}:{reader.line_num}: the {text_column!r} column is empty; fill or drop that row."
                     for row in reader if row[text_column] is None), None)
    if content.lstrip().startswith("["):  # one JSON array of records
        try:
            records = list(enumerate(json.loads(content), 1))
        except ValueError as error:
            return f"{path} is not valid JSON ({error}): a .json file holds one array of objects, or one object per line."
        return next((f"{path} record {i}{p}" for i, r in records if (p := _record_problem(r, text_column))), None)
    for number, line in enumerate(content.splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError as error:
                return f"{path}:{number} is not a JSON line ({error}): a .json file holds one array of objects, or one object per line."
            if problem := _record_problem(record, text_column):
                return f"{path}:{number}{problem}"
    return None


def read_text_files(paths: list[str], text_column: str = "text", sample_by: str = SAMPLE_BY[0]) -> list[str]:
    """The documents of data files, in memory (small files: tests, the demo)."""
    return [text for batch in Source(paths, text_column=text_column, sample_by=sample_by).texts() for text in batch]
