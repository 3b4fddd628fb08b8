"""Text data: the built-in corpus, a tokenizer trained on it, and packing into fixed-length blocks.

The built-in corpus is the Python language reference that every CPython installation ships as
`pydoc_data.topics` (~460 KB of English prose and code), so the demo and the tests need no download.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>"]


def builtin_corpus() -> list[str]:
    """The documents of the built-in corpus (one per language-reference topic, in a fixed order)."""
    from pydoc_data.topics import topics

    return [topics[key].strip() for key in sorted(topics)]


def train_tokenizer(texts: list[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style) trained on `texts` in a second or two."""
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


def pack(texts: list[str], tokenizer, block_size: int) -> torch.Tensor:
    """Tokenize, join documents with EOS and cut into `[N, block_size]` blocks (the remainder is dropped)."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // block_size
    if n == 0:
        raise ValueError(f"The corpus has {len(ids)} tokens, fewer than one block of block_size={block_size}.")
    return torch.tensor(ids[: n * block_size]).view(n, block_size)


def read_text_files(paths: list[str], text_column: str = "text") -> list[str]:
    """Documents from .txt files (blank-line separated blocks) and .jsonl files (one object per line)."""
    docs: list[str] = []
    for path in paths:
        raw = Path(path).read_bytes()
        try:
            content = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            line = raw[: error.start].count(b"\n") + 1
            raise ValueError(
                f"{path}:{line} is not UTF-8 text (byte {error.start}: {raw[error.start:error.start + 1]!r}); training "
                "files are .txt or .jsonl text. Convert the file, or point --train_file at the text."
            ) from None
        if path.endswith((".jsonl", ".json")):
            for number, line in enumerate(content.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as error:
                    raise ValueError(
                        f"{path}:{number} is not a JSON line ({error}): a .jsonl file holds one JSON object per line."
                    ) from None
                if not isinstance(record, dict):
                    raise ValueError(f"{path}:{number} is a JSON {type(record).__name__}, not an object with a {text_column!r} field.")
                if text_column not in record:
                    raise ValueError(f"{path}:{number} has no {text_column!r} field (fields: {sorted(record)}); set --text_column.")
                docs.append(str(record[text_column]))
        else:
            docs.extend(block.strip() for block in content.split("\n\n") if block.strip())
    return docs


def read_dataset(name: str, config_name: str | None, split: str, text_column: str) -> list[str]:
    """Documents of a `datasets` dataset: a folder written by `save_to_disk`, or a name in the local cache."""
    import datasets

    if Path(name).is_dir():
        data = datasets.load_from_disk(name)
        data = data[split] if isinstance(data, datasets.DatasetDict) else data
    else:
        data = datasets.load_dataset(name, config_name, split=split)
    if text_column not in data.column_names:
        raise ValueError(f"Dataset {name} has no column {text_column!r} (columns: {data.column_names}); set --text_column.")
    return [str(t) for t in data[text_column]]
