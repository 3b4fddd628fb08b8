"""Text data: the built-in corpus, a tokenizer trained on it, and packing into fixed-length blocks.

The built-in corpus is the Python language reference that every CPython installation ships as
`pydoc_data.topics` (~460 KB of English prose and code), so the demo and the tests need no download.
"""

from __future__ import annotations

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
