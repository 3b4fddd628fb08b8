"""The training data path (hf_ppmoe.training.block_data / data): every source kind gives the blocks of packing its
documents; prepared once and reused from the cache; no trusted cache entry after a kill while preparing; same seed
same batches; ranks' batches disjoint and together one process's (also across 2 processes, tokenized once per node);
a streamed run resumed after a kill reads exactly the uninterrupted batches; bad data named by file and line."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_ppmoe.training import TrainArguments, main
from hf_ppmoe.training import block_data as blocks_module
from hf_ppmoe.training.block_data import load_data, tokenize
from hf_ppmoe.training.data import builtin_corpus, pack, train_tokenizer
from hf_ppmoe.training.tracking import read_jsonl
from helpers import KILLED_AFTER_STEP_5

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
DOCS = builtin_corpus()[:12]
ALL = "\n\n".join(DOCS)  # all.txt, whole: its one document (--sample_by document, the default)
PARAGRAPHS = [p.lstrip("\n").rstrip() for p in ALL.split("\n\n") if p.strip()]  # --sample_by paragraph (indents kept)
LINES = [line.rstrip() for line in ALL.splitlines() if line.strip()]  # --sample_by line
B = 16


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(builtin_corpus()[:40], vocab_size=300)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The same 12 documents as 3 .jsonl shards, as .parquet, .csv and a save_to_disk folder; and as one .txt (one
    document, or cut at its blank lines or lines, --sample_by)."""
    import datasets

    root = tmp_path_factory.mktemp("shards")
    (root / "all.txt").write_text("\n\n".join(DOCS) + "\n")
    for i in range(3):
        (root / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": t, "id": n}) + "\n" for n, t in enumerate(DOCS[i * 4 : i * 4 + 4])))
    table = datasets.Dataset.from_dict({"id": list(range(12)), "text": DOCS})
    table.to_parquet(str(root / "all.parquet"))
    table.to_csv(str(root / "all.csv"), index=False)
    table.save_to_disk(str(root / "saved"))
    return root


def arguments(tmp_path, **extra):
    values = dict(block_size=B, per_device_train_batch_size=4, data_cache_dir=str(tmp_path / "cache"), eval_batches=2)
    return TrainArguments(**{**values, **extra})


def test_every_source_kind_packs_the_same_blocks(shards, tokenizer, tmp_path):
    for source, documents in (
        (dict(train_file=[str(shards / "all.txt")]), [ALL]),
        (dict(train_file=[str(shards / "all.txt")], sample_by="paragraph"), PARAGRAPHS),
        (dict(train_file=[str(shards / "all.txt")], sample_by="line"), LINES), (dict(train_file=[str(shards / "part-*.jsonl")]), DOCS),
        (dict(train_file=[str(shards / "all.parquet")]), DOCS), (dict(train_file=[str(shards / "all.csv")]), DOCS),
        (dict(dataset_name=str(shards / "saved")), DOCS),
    ):
        expected = pack(documents, tokenizer, B)
        data = load_data(arguments(tmp_path, validation_split_percentage=10, **source), tokenizer)
        held = max(1, len(expected) * 10 // 100)
        assert data.num_blocks == len(expected) - held, source
        assert torch.equal(torch.from_numpy(data.train[:]["input_ids"]).long(), expected[:-held]), source
        assert torch.equal(torch.from_numpy(data.validation[:]["input_ids"]).long(), expected[-held:]), source
        assert len({f.name for f in (tmp_path / "cache").iterdir()}) >= 1


def test_a_txt_file_is_one_document_by_default_code_and_all(tmp_path):
    """Issue 46: .txt files were cut at every blank line, which cuts code inside its functions (and took the first
    line's indentation). By default a file is one document, as `datasets`' text loader names it (sample_by="document");
    "paragraph" and "line" cut it as their names say, and every mode keeps indentation. Each is its own cache key."""
    from hf_ppmoe.training.data import Source, read_text_files

    code = "    x = 1\n\ndef add(a, b):\n    total = a + b\n\n    return total\n\n\n"
    (tmp_path / "code.txt").write_text(code)
    files = [str(tmp_path / "code.txt")]
    assert read_text_files(files) == [code.rstrip()]
    assert read_text_files(files, sample_by="paragraph") == ["    x = 1", "def add(a, b):\n    total = a + b", "    return total"]
    assert read_text_files(files, sample_by="line") == ["    x = 1", "def add(a, b):", "    total = a + b", "    return total"]
    keys = [Source(files, sample_by=mode).key() for mode in ("document", "paragraph", "line")]
    assert len({json.dumps(k) for k in keys}) == 3
    with pytest.raises(ValueError, match="--sample_by sentence: use one of document, paragraph, line"):
        TrainArguments(train_file=files, sample_by="sentence")


def test_builtin_corpus_and_validation_file(shards, tokenizer, tmp_path):
    data = load_data(arguments(tmp_path), tokenizer)  # the demo's / README's first command's data
    assert data.num_blocks == len(pack(builtin_corpus(), tokenizer, B)) - max(1, len(pack(builtin_corpus(), tokenizer, B)) // 20)
    data = load_data(arguments(tmp_path, train_file=[str(shards / "all.txt")], validation_file=[str(shards / "part-0.jsonl")],
                               sample_by="paragraph"), tokenizer)
    assert data.num_blocks == len(pack(PARAGRAPHS, tokenizer, B))  # nothing held out of train
    batches = list(data.validation_batches())
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]), pack(DOCS[:4], tokenizer, B)[:8])
    assert all(torch.equal(b["input_ids"], b["labels"]) for b in batches)


def test_cache_is_reused_and_follows_the_files(shards, tokenizer, tmp_path, monkeypatch):
    (tmp_path / "train.txt").write_text((shards / "all.txt").read_text())
    args = arguments(tmp_path, train_file=[str(tmp_path / "train.txt")])
    first = load_data(args, tokenizer)
    calls = []
    monkeypatch.setattr(blocks_module, "tokenize", lambda *a: calls.append(1) or tokenize(*a))
    second = load_data(args, tokenizer)
    assert first.prepared_here and not second.prepared_here and calls == []  # the second run does not tokenize
    assert second.fingerprint == first.fingerprint and torch.equal(second.batch(3, 0)["input_ids"], first.batch(3, 0)["input_ids"])
    with open(tmp_path / "train.txt", "a") as f:  # a changed file is prepared again
        f.write("\n\n" + DOCS[1] + "\n")
    third = load_data(args, tokenizer)
    assert third.prepared_here and calls and third.num_blocks > first.num_blocks
    other = train_tokenizer(builtin_corpus()[:40], vocab_size=280)  # so is another tokenizer
    assert load_data(args, other).prepared_here


def test_same_seed_same_batches_and_ranks_split_one_process(shards, tokenizer, tmp_path):
    args = arguments(tmp_path, train_file=[str(shards / "all.txt")], gradient_accumulation_steps=2)
    one = load_data(arguments(tmp_path, train_file=[str(shards / "all.txt")], per_device_train_batch_size=8), tokenizer)
    again = load_data(args, tokenizer)
    ranks = [load_data(args, tokenizer, rank, 2) for rank in range(2)]
    for step in range(6):  # past the end of an epoch (num_blocks rows)
        for micro in range(2):
            parts = [r.batch(step, micro)["input_ids"] for r in ranks]
            assert torch.equal(torch.cat(parts), one.batch(2 * step + micro, 0)["input_ids"])
        assert torch.equal(again.batch(step, 1)["input_ids"], load_data(args, tokenizer).batch(step, 1)["input_ids"])
    reseeded = load_data(arguments(tmp_path, train_file=[str(shards / "all.txt")], seed=1), tokenizer)
    assert not torch.equal(reseeded.batch(0, 0)["input_ids"], again.batch(0, 0)["input_ids"])


PREPARE_AND_DIE = """
import os, signal, sys
from hf_ppmoe.training import TrainArguments, block_data as blocks
from hf_ppmoe.training.data import builtin_corpus, train_tokenizer

tokenize, calls = blocks.tokenize, []

def tokenize_then_die(texts, tokenizer):
    calls.append(1)
    if len(calls) == 2:  # the first batch is written
        os.kill(os.getpid(), signal.SIGKILL)
    return tokenize(texts, tokenizer)

blocks.tokenize, blocks.TEXT_BATCH = tokenize_then_die, 5
args = TrainArguments(train_file=[sys.argv[1]], block_size=16, data_cache_dir=sys.argv[2], sample_by="paragraph")
blocks.load_data(args, train_tokenizer(builtin_corpus()[:40], vocab_size=300))
"""


def test_killed_preparation_leaves_no_entry(shards, tokenizer, tmp_path):
    result = subprocess.run([sys.executable, "-c", PREPARE_AND_DIE, str(shards / "all.txt"), str(tmp_path / "cache")],
                            env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert not list((tmp_path / "cache").glob("*/info.json")) and list((tmp_path / "cache").glob(".*.saving-*"))
    data = load_data(arguments(tmp_path, train_file=[str(shards / "all.txt")], sample_by="paragraph"), tokenizer)
    total = len(pack(PARAGRAPHS, tokenizer, B))
    assert data.prepared_here and data.num_blocks == total - max(1, total * 5 // 100)
    assert not list((tmp_path / "cache").glob(".*.saving-*"))  # the dead writer's folder is cleaned up


def test_streamed_resume_and_rank_split(shards, tokenizer, tmp_path):
    args = arguments(tmp_path, train_file=[str(shards / "part-*.jsonl")], streaming=True, shuffle_buffer_size=8,
                     validation_split_percentage=0)
    run = load_data(args, tokenizer)
    first = [run.batch(step, 0)["input_ids"] for step in range(3)]
    state = json.loads(json.dumps(run.state_dict()))  # as a checkpoint keeps it
    rest = [run.batch(step, 0)["input_ids"] for step in range(3, 12)]  # past the end of the first epoch
    resumed = load_data(args, tokenizer)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, resumed.batch(step, 0)["input_ids"]) for step, a in zip(range(3, 12), rest))
    again = load_data(args, tokenizer)
    assert all(torch.equal(a, again.batch(step, 0)["input_ids"]) for step, a in enumerate(first))  # same seed
    with pytest.raises(RuntimeError, match="read in order"):
        again.batch(7, 0)
    # ranks: each packs its own documents (whole shards when they divide evenly), none twice, together all of them;
    # without a shuffle buffer a rank's blocks are its documents' tokens in order
    in_order = arguments(tmp_path, train_file=[str(shards / "part-*.jsonl")], streaming=True, shuffle_buffer_size=1,
                         validation_split_percentage=0, per_device_train_batch_size=1, sample_by="paragraph")
    for files, world in (([str(shards / "part-*.jsonl")], 3), ([str(shards / "all.txt")], 2)):
        in_order.train_file = files
        seen = []
        for rank in range(world):
            data = load_data(in_order, tokenizer, rank, world)
            texts = [t for batch in data.source.batches(data.dataset, 100) for t in batch]
            seen += texts
            ids = tokenize(texts, tokenizer)
            got = torch.cat([data.batch(step, 0)["input_ids"] for step in range(len(ids) // B)]).flatten()
            assert torch.equal(got, torch.from_numpy(ids[: len(ids) // B * B]).long())
        assert sorted(seen) == sorted(DOCS if files[0].endswith("jsonl") else PARAGRAPHS)


def test_streamed_validation_is_held_out(shards, tokenizer, tmp_path):
    args = arguments(tmp_path, train_file=[str(shards / "all.txt")], streaming=True, validation_split_percentage=30,
                     eval_batches=0, per_device_train_batch_size=1, shuffle_buffer_size=1, sample_by="paragraph")
    data = load_data(args, tokenizer)
    held = [t for t in PARAGRAPHS if blocks_module._held_out(t, 30)]
    assert 0 < len(held) < len(PARAGRAPHS)
    validation = torch.cat([b["input_ids"] for b in data.validation_batches()])
    assert torch.equal(validation, pack(held, tokenizer, B))
    kept = tokenize([t for t in PARAGRAPHS if t not in held], tokenizer)
    got = torch.cat([data.batch(step, 0)["input_ids"] for step in range(len(kept) // B)]).flatten()
    assert torch.equal(got, torch.from_numpy(kept[: len(kept) // B * B]).long())


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.jsonl", '{"text": "a"}\n{"body": "b"}\n', r"missing.jsonl:2 has no 'text' field \(fields: \['body'\]\); set --text_column"),
        ("torn.jsonl", '{"text": "a"}\n{"text": "b', r"torn.jsonl:2 is not a JSON line .* torn or unfinished line"),
        ("latin.txt", b"fine\n\ncaf\xe9\n", r"latin.txt:3 is not UTF-8 text .*iconv"),
        ("latin.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', r"latin.jsonl:2 is not UTF-8 text"),
        ("latin.csv", b"text\nfine\ncaf\xe9\n", r"latin.csv:3 is not UTF-8 text"),
        ("nocolumn.csv", "body\nx\n", r"nocolumn.csv has no column 'text' \(header: \['body'\]\); set --text_column"),
        ("nocolumn.parquet", None, r"nocolumn.parquet has no column 'text' \(columns: \['body'\]\); set --text_column"),
        ("empty.txt", "\n\n\n", r"empty.txt has no documents"),
        ("short.txt", "a few words\n", r"short.txt has \d+ tokens, fewer than one block of --block_size 16; lower --block_size"),
    ],
)
def test_bad_data_is_named_with_the_fix(name, content, message, tokenizer, tmp_path):
    path = tmp_path / name
    if content is None:
        import datasets

        datasets.Dataset.from_dict({"body": ["x", "y"]}).to_parquet(str(path))
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    for streaming in (False, True):
        with pytest.raises(ValueError, match=message):
            data = load_data(arguments(tmp_path, train_file=[str(path)], streaming=streaming), tokenizer)
            data.batch(0, 0)
    assert not list((tmp_path / "cache").glob("*/info.json"))


def test_data_file_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"matches no file"):
        TrainArguments(train_file=[str(tmp_path / "*.jsonl")]).validate()
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.jsonl").write_text("{}")
    with pytest.raises(ValueError, match=r"different kinds \(json, text\)"):
        TrainArguments(train_file=[str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]).validate()
    (tmp_path / "c.xml").write_text("x")
    with pytest.raises(ValueError, match=r"c.xml: use .txt"):
        TrainArguments(train_file=[str(tmp_path / "c.xml")]).validate()


RANKS = Path(__file__).with_name("data_ranks.py")


def test_two_processes_tokenize_once_and_split_the_batches(shards, tokenizer, tmp_path):
    """2 processes (one node) with one cache: the main process prepares the entry, the other tokenizes nothing and
    maps it; their batches are disjoint and together one process's; streamed, their documents are disjoint and
    together all of them."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(RANKS),
               str(shards), str(tmp_path)]
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["prepared_here"] for r in ranks] == [True, False] and [r["tokenized"] > 0 for r in ranks] == [True, False]
    assert len(list((tmp_path / "cache").glob("*/info.json"))) == 1
    one = load_data(arguments(tmp_path, train_file=[str(shards / "all.txt")], per_device_train_batch_size=8), tokenizer)
    assert not one.prepared_here  # the entry the 2 processes wrote
    for step in range(4):
        parts = [torch.tensor(r["batches"][step]) for r in ranks]
        assert not {tuple(x) for x in parts[0].tolist()} & {tuple(x) for x in parts[1].tolist()}
        assert torch.equal(torch.cat(parts), one.batch(step, 0)["input_ids"])
    streamed = [set(r["streamed_documents"]) for r in ranks]
    assert not streamed[0] & streamed[1] and streamed[0] | streamed[1] == set(DOCS)




def test_streamed_run_killed_and_resumed_reads_the_uninterrupted_batches(shards, tmp_path):
    from transformers import HfArgumentParser

    from hf_ppmoe import GPTMoEConfig

    GPTMoEConfig(
        vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
    ).to_json_file(tmp_path / "config.json")

    def flags(out, **extra):
        values = dict(train_file=str(shards / "part-*.jsonl"), config_name=str(tmp_path / "config.json"), output_dir=str(out),
                      max_steps=6, per_device_train_batch_size=4, block_size=32, eval_steps=3, eval_batches=1,
                      learning_rate=3e-3, warmup_steps=1, plots="False", streaming="True", shuffle_buffer_size=16,
                      checkpointing_steps=2, data_cache_dir=str(tmp_path / "cache"),
                      validation_file=str(shards / "part-0.jsonl"), **extra)
        return [f"--{k}={v}" for k, v in values.items()]

    main(HfArgumentParser(TrainArguments).parse_args_into_dataclasses(flags(tmp_path / "reference"))[0])
    run = tmp_path / "killed"
    result = subprocess.run([sys.executable, "-c", KILLED_AFTER_STEP_5, *flags(run)], env=ENV, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == -9, result.stderr[-3000:]
    assert (run / "checkpoints" / "step_4" / "data_state_0.pt").is_file()
    main(HfArgumentParser(TrainArguments).parse_args_into_dataclasses(flags(run, resume="latest"))[0])

    def losses(out):
        return {r["step"]: r["train/lm_loss"] for r in read_jsonl(out / "logs" / "metrics.jsonl") if "train/lm_loss" in r}

    resumed, expected = losses(run), losses(tmp_path / "reference")
    assert resumed.keys() == expected.keys() == set(range(1, 7))
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-6), step
