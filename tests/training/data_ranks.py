"""One process of `test_data.py`'s 2-process test: `torchrun --nproc-per-node 2 data_ranks.py SHARDS OUT`. Each rank
loads the prepared data of SHARDS/all.txt (cache OUT/cache, main process first) and streamed data of the .jsonl shards,
counts its tokenizer calls, and writes OUT/rank{R}.json: whether it prepared the entry, its batches of 4 steps and
the documents its stream holds."""

import json
import sys
from pathlib import Path

from accelerate import Accelerator

from hf_ppmoe.training import TrainArguments, block_data as blocks
from hf_ppmoe.training.data import builtin_corpus, train_tokenizer

shards, out = Path(sys.argv[1]), Path(sys.argv[2])
calls = []
tokenize = blocks.tokenize
blocks.tokenize = lambda *a: calls.append(1) or tokenize(*a)
accelerator = Accelerator(cpu=True)
rank, world = accelerator.process_index, accelerator.num_processes
tokenizer = train_tokenizer(builtin_corpus()[:40], vocab_size=300)
args = TrainArguments(train_file=[str(shards / "all.txt")], block_size=16, per_device_train_batch_size=4,
                      data_cache_dir=str(out / "cache"))
data = blocks.load_data(args, tokenizer, rank, world, accelerator.local_main_process_first)
record = {"prepared_here": data.prepared_here, "tokenized": len(calls),
          "batches": [data.batch(step, 0)["input_ids"].tolist() for step in range(4)]}
args.train_file, args.streaming = [str(shards / "part-*.jsonl")], True
streamed = blocks.load_data(args, tokenizer, rank, world)
record["streamed_documents"] = [t for batch in streamed.source.batches(streamed.dataset, 100) for t in batch]
(out / f"rank{rank}.json").write_text(json.dumps(record))
accelerator.wait_for_everyone()
accelerator.end_training()
