"""The training loop's data: an object that hands each data-parallel process its blocks of `block_size` token ids,
`load_data(args, tokenizer, rank, world, main_process_first)`. The loop asks only this (see `train.py`):

    data.batch(step, micro) -> dict     model inputs of this process for (optimizer step, micro-step), on the CPU
    data.validation_batches() -> list   this process's validation batches
    data.state_dict() / load_state_dict(state)   the data position a checkpoint keeps ({} when the order is a pure
                                        function of the seed and the step)
    data.fingerprint                    what decides the batches (recorded in every checkpoint: a resume on other
                                        data is refused)

Documents (`data.Source`) are tokenized in batches with the fast tokenizer (its Rust threads encode a batch in
parallel), joined with EOS and cut into blocks; a block may span documents, the remainder is dropped.

- Prepared (default): the blocks are written once into an Arrow file in a cache entry keyed by what determines them
  (the files' paths, sizes and modification times or the dataset's fingerprint, the tokenizer, block size, text
  column, validation source) and memory-mapped by every process (`PackedData`); the next run with the same key
  reuses the entry. With several processes the main one of each node prepares it first and the others map the same
  files (no process holds a copy in RAM). An entry is written into a temporary folder that takes its name only when
  complete (`hf_ppmoe.utils.atomic`), so a run killed while preparing leaves nothing a later run would trust. The
  global batch of step s is the s-th slice of per-epoch seeded permutations of the blocks, cut into micro-batches and
  ranks (`batch_rows`). Validation: `--validation_file`, or the last `--validation_split_percentage` of the blocks.
- Streamed (`--streaming`, `StreamedData`): each rank reads its part of the documents
  (`datasets.distributed.split_dataset_by_node`), packs them on the fly and draws blocks at random from a buffer of
  `--shuffle_buffer_size` blocks. Its state (the stream's `IterableDataset.state_dict()`, the tokens carried into the
  next block, the buffer and its random generator) is part of every checkpoint, so a resumed run reads exactly the
  blocks an uninterrupted one would. Validation: `--validation_file`, or the documents whose CRC-32 falls in the
  held-out percentage (the same documents whatever the order or the number of ranks).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
import zlib
from collections import deque
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from ..utils.atomic import atomic_folder
from .data import Source

TEXT_BATCH = 1000  # documents tokenized together
WRITE_TOKENS = 2**22  # tokens per Arrow record batch: few batch headers, so mapping a file touches few of its pages
FORMAT = 1  # the layout of a cache entry; a new layout makes new keys


def batch_rows(step: int, micro: int, process: int, world: int, batch_size: int, accumulation: int, seed: int,
               n_blocks: int) -> torch.Tensor:
    """Rows of `n_blocks` for (optimizer step, micro-step, data-parallel process): the global batch of step s is the
    s-th slice of per-epoch seeded permutations, cut into micro-batches and processes. A pure function of its
    arguments, so a resumed run reads exactly what an uninterrupted one would."""
    b = batch_size
    start = (step * accumulation + micro) * world * b + process * b
    positions = torch.arange(start, start + b)
    epochs, offsets = positions // n_blocks, positions % n_blocks
    rows = torch.empty(b, dtype=torch.long)
    for epoch in range(start // n_blocks, (start + b - 1) // n_blocks + 1):  # the epochs these b positions span
        perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        rows[epochs == epoch] = perm[offsets[epochs == epoch]]
    return rows


def tokenizer_hash(tokenizer) -> str:
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"{type(tokenizer).__name__} is a slow (Python) tokenizer; the data path needs a fast one. Save the model's "
            "tokenizer with a tokenizer.json (AutoTokenizer.from_pretrained(..., use_fast=True)) and pass --tokenizer_name."
        )
    state = tokenizer.backend_tokenizer.to_str() + json.dumps([tokenizer.eos_token_id, tokenizer.init_kwargs.get("add_bos_token")])
    return hashlib.sha256(state.encode()).hexdigest()


def tokenize(texts: list[str], tokenizer) -> np.ndarray:
    """The documents' token ids, each followed by EOS, in one array."""
    ids = tokenizer(texts, verbose=False)["input_ids"]
    eos = [tokenizer.eos_token_id]
    return np.fromiter(itertools.chain.from_iterable(x + eos for x in ids), dtype=np.int32)


class Packer:
    """Cuts a stream of token ids into blocks, carrying the remainder into the next call."""

    def __init__(self, block_size: int, carry=()):
        self.block_size, self.carry = block_size, np.asarray(carry, dtype=np.int32)

    def add(self, ids: np.ndarray) -> np.ndarray:
        tokens = np.concatenate([self.carry, ids])
        n = len(tokens) // self.block_size
        self.carry = tokens[n * self.block_size :].copy()
        return tokens[: n * self.block_size].reshape(n, self.block_size)


def _short(source, tokens: int, block_size: int) -> ValueError:
    if tokens == 0:
        return ValueError(f"{source} has no documents (no non-empty text); check --train_file / --text_column.")
    return ValueError(
        f"{source} has {tokens} tokens, fewer than one block of --block_size {block_size}; lower --block_size or add text."
    )


def _batch(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": ids, "labels": ids}


def _rank_batches(blocks, args, rank: int, world: int) -> list[dict]:
    """This rank's validation batches: the first `eval_batches` batches of the blocks, dealt round-robin to ranks."""
    b = args.per_device_train_batch_size
    starts = list(range(0, len(blocks), b))[: args.eval_batches or None]
    return [_batch(torch.as_tensor(np.asarray(blocks[start : start + b]), dtype=torch.long)) for start in starts[rank::world]]


# ---------------------------------------------------------------------------------------------------- prepared
def write_blocks(source: Source, path: Path, tokenizer, block_size: int) -> dict:
    """Tokenize and pack `source` into an Arrow stream file of blocks; returns {blocks, tokens, sha256}."""
    import pyarrow as pa

    schema = pa.schema({"input_ids": pa.list_(pa.int32(), block_size)})
    packer, digest, blocks, tokens, waiting = Packer(block_size), hashlib.sha256(), 0, 0, []

    def write():
        new = np.concatenate(waiting)
        writer.write_batch(pa.record_batch([pa.FixedSizeListArray.from_arrays(pa.array(new.ravel()), block_size)], schema=schema))
        digest.update(new.tobytes())
        waiting.clear()

    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for texts in source.texts(batch_size=TEXT_BATCH):
            ids = tokenize(texts, tokenizer)
            tokens += len(ids)
            waiting.append(packer.add(ids))
            blocks += len(waiting[-1])
            if sum(map(len, waiting)) * block_size >= WRITE_TOKENS:
                write()
        if waiting:
            write()
    if blocks == 0:
        raise _short(source, tokens, block_size)
    return {"blocks": blocks, "tokens": tokens, "sha256": digest.hexdigest()}


def cache_root(args) -> Path:
    import datasets

    return Path(args.data_cache_dir or Path(datasets.config.HF_DATASETS_CACHE) / "hf_ppmoe_blocks")


def prepare(train: Source, validation: Source | None, tokenizer, args) -> tuple[Path, bool]:
    """The cache entry of these blocks (written now if there is none); returns (folder, whether it was written now)."""
    key = {
        "format": FORMAT, "train": train.key(), "tokenizer": tokenizer_hash(tokenizer), "block_size": args.block_size,
        "validation": validation.key() if validation else None,
    }
    entry = cache_root(args) / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    if (entry / "info.json").is_file():
        return entry, False
    entry.parent.mkdir(parents=True, exist_ok=True)
    clock = time.perf_counter()
    with atomic_folder(entry, overwrite=True) as staging:
        info = {"key": key, "train": write_blocks(train, staging / "train.arrow", tokenizer, args.block_size)}
        if validation:
            info["validation"] = write_blocks(validation, staging / "validation.arrow", tokenizer, args.block_size)
        info["seconds"] = time.perf_counter() - clock
        (staging / "info.json").write_text(json.dumps(info, indent=1))
    return entry, True


class PackedData:
    """Blocks prepared into a cache entry, memory-mapped; see the module docstring."""

    def __init__(self, entry: Path, args, rank: int = 0, world: int = 1, prepared_here: bool = False):
        import datasets

        self.entry, self.args, self.rank, self.world, self.prepared_here = entry, args, rank, world, prepared_here
        info = json.loads((entry / "info.json").read_text())
        blocks = datasets.Dataset.from_file(str(entry / "train.arrow")).with_format("numpy")
        total = info["train"]["blocks"]
        if (entry / "validation.arrow").is_file():
            self.validation = datasets.Dataset.from_file(str(entry / "validation.arrow")).with_format("numpy")
            n = total
        else:  # the last blocks held out
            held = max(1, total * args.validation_split_percentage // 100) if args.validation_split_percentage else 0
            n = total - held
            if n < 1:
                raise ValueError(
                    f"Not enough training text for one block of {args.block_size} tokens after holding out validation "
                    f"({total} blocks in all); add text, lower --block_size, or pass --validation_file."
                )
            self.validation = blocks.select(range(n, total))
        self.train = blocks.select(range(n))
        self.num_blocks = n
        self.fingerprint = hashlib.sha256(f"{info['train']['sha256']}:{n}".encode()).hexdigest()

    def __str__(self) -> str:
        done = "prepared now" if self.prepared_here else "reused from the cache"
        return f"{self.num_blocks} training blocks of {self.args.block_size} tokens in {self.entry} ({done})"

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        a = self.args
        rows = batch_rows(step, micro, self.rank, self.world, a.per_device_train_batch_size, a.gradient_accumulation_steps,
                          a.seed, self.num_blocks)
        return _batch(torch.from_numpy(self.train[rows.numpy()]["input_ids"]).long())

    def validation_batches(self) -> list[dict]:
        return _rank_batches(_Column(self.validation), self.args, self.rank, self.world)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class _Column:
    """The input_ids of a numpy-formatted Dataset, sliced as an array."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, rows: slice):
        return self.dataset[rows]["input_ids"]


# ---------------------------------------------------------------------------------------------------- streamed
def _held_out(text: str, percentage: int) -> bool:
    return zlib.crc32(text.encode()) % 100 < percentage


class StreamedData:
    """Blocks packed on the fly from this rank's part of a document stream; see the module docstring."""

    def __init__(self, train: Source, validation: Source | None, tokenizer, args, rank: int = 0, world: int = 1):
        from datasets.distributed import split_dataset_by_node

        self.source, self.validation_source, self.tokenizer, self.args = train, validation, tokenizer, args
        self.rank, self.world, self.prepared_here = rank, world, False
        self.dataset = split_dataset_by_node(train.dataset(streaming=True), rank, world)
        self.percentage = 0 if validation else args.validation_split_percentage
        self.num_blocks = None  # unknown before the stream has been read through
        key = {"train": train.key(streaming=True), "validation": validation.key(streaming=True) if validation else self.percentage,
               "tokenizer": tokenizer_hash(tokenizer), "block_size": args.block_size, "buffer": args.shuffle_buffer_size}
        self.fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        self._validation = None
        self.load_state_dict({})

    def __str__(self) -> str:
        return f"blocks of {self.args.block_size} tokens streamed from {self.source}"

    def state_dict(self) -> dict:
        return {
            "stream": self.dataset.state_dict() if self._reading else self._stream, "epoch": self.epoch, "epoch_blocks": self.epoch_blocks,
            "next": self.next, "carry": self.packer.carry.tolist(), "pending": [b.tolist() for b in self.pending],
            "buffer": [b.tolist() for b in self.buffer], "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (a `state_dict()`); {}: from the start."""
        self.epoch, self.epoch_blocks, self.next = state.get("epoch", 0), state.get("epoch_blocks", 0), state.get("next", [0, 0])
        self.packer = Packer(self.args.block_size, state.get("carry", ()))
        self.pending = deque(np.asarray(b, dtype=np.int32) for b in state.get("pending", []))
        self.buffer = [np.asarray(b, dtype=np.int32) for b in state.get("buffer", [])]
        self.rng = np.random.default_rng([self.args.seed, self.rank])
        if "rng" in state:
            self.rng.bit_generator.state = state["rng"]
        self._stream, self._reading = state.get("stream"), False  # the stream's state until it is read again
        if self._stream is not None:
            self.dataset.load_state_dict(self._stream)
        self.dataset.set_epoch(self.epoch)
        self._texts = self.source.batches(self.dataset, TEXT_BATCH)

    def _pull(self) -> np.ndarray:
        """The next packed block of the stream (a new epoch starts where the last one ends)."""
        while not self.pending:
            self._reading = True
            texts = next(self._texts, None)
            if texts is None:
                if self.epoch_blocks == 0:
                    part = f" (the part of data-parallel rank {self.rank} of {self.world})" if self.world > 1 else ""
                    raise _short(f"{self.source}{part}", len(self.packer.carry), self.args.block_size)
                self.epoch, self.epoch_blocks = self.epoch + 1, 0
                self.dataset.set_epoch(self.epoch)
                self._texts = self.source.batches(self.dataset, TEXT_BATCH)
                continue
            texts = [t for t in texts if not _held_out(t, self.percentage)] if self.percentage else texts
            new = self.packer.add(tokenize(texts, self.tokenizer)) if texts else ()
            self.epoch_blocks += len(new)
            self.pending.extend(new)
        return self.pending.popleft()

    def _block(self) -> np.ndarray:
        while len(self.buffer) < self.args.shuffle_buffer_size:
            self.buffer.append(self._pull())
        j = int(self.rng.integers(len(self.buffer)))
        block, self.buffer[j] = self.buffer[j], self._pull()
        return block

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        """The next batch of the stream, which must be (step, micro): streamed batches are read in order."""
        if [step, micro] != list(self.next):
            raise RuntimeError(f"Streamed data is read in order: the next batch is step {self.next[0]} micro-step "
                               f"{self.next[1]}, not step {step} micro-step {micro}.")
        last = micro + 1 == self.args.gradient_accumulation_steps
        self.next = [step + 1, 0] if last else [step, micro + 1]
        blocks = np.stack([self._block() for _ in range(self.args.per_device_train_batch_size)])
        return _batch(torch.from_numpy(blocks).long())

    def validation_batches(self) -> list[dict]:
        if self._validation is None:
            self._validation = self._read_validation()
        return _rank_batches(self._validation, self.args, self.rank, self.world)

    def _read_validation(self) -> np.ndarray:
        """The first `eval_batches` batches of validation blocks (all with --eval_batches 0), read once."""
        wanted = self.args.eval_batches * self.args.per_device_train_batch_size or None
        source = self.validation_source or self.source
        packer, blocks, tokens = Packer(self.args.block_size), [], 0
        for texts in source.texts(batch_size=TEXT_BATCH):
            texts = texts if self.validation_source else [t for t in texts if _held_out(t, self.percentage)]
            ids = tokenize(texts, self.tokenizer) if texts else np.zeros(0, np.int32)
            tokens += len(ids)
            blocks.extend(packer.add(ids))
            if wanted and len(blocks) >= wanted:
                break
        if not blocks and self.validation_source:
            raise _short(f"The validation data {source}", tokens, self.args.block_size)
        if not blocks and self.percentage:
            raise ValueError(
                f"The documents of {source} held out for validation (those whose CRC-32 % 100 < "
                f"--validation_split_percentage {self.percentage}) make no block of --block_size {self.args.block_size} "
                f"({tokens} tokens); raise --validation_split_percentage or pass --validation_file."
            )
        return np.stack(blocks[:wanted]) if blocks else np.zeros((0, self.args.block_size), np.int32)


def load_data(args, tokenizer, rank: int = 0, world: int = 1, main_process_first=nullcontext):
    """The training data of `args` for data-parallel `rank` of `world`: `StreamedData` with --streaming, else
    `PackedData` (prepared under `main_process_first`, e.g. Accelerator.local_main_process_first: one process per
    node writes the cache entry, the others then find it)."""
    train, validation = Source.of(args), Source.of(args, validation=True)
    if args.streaming:
        return StreamedData(train, validation, tokenizer, args, rank, world)
    with main_process_first():
        entry, prepared_here = prepare(train, validation, tokenizer, args)
    return PackedData(entry, args, rank, world, prepared_here)
