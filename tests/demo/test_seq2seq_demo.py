"""`hf-ppmoe demo --seq2seq --quick`: every stage runs; the report is rendered from results.json alone and its
numbers are the runs' logs and models; the dense baseline at equal active parameters has the MoE's active parameters
(router aside); the built-in task is split by file with no function of a held-out file in training."""

import json
import re

import pytest
from transformers import AutoModelForSeq2SeqLM

from hf_ppmoe_cli import main as cli
from hf_ppmoe.demo.report import judge
from hf_ppmoe.demo.seq2seq import report_markdown
from hf_ppmoe.training.stdlib_task import EVALUATION_FILES, file_pairs, first_sentence, stdlib_pairs, stdlib_root
from hf_ppmoe.training.tracking import read_jsonl


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_seq2seq")
    assert cli(["demo", "--seq2seq", "--quick", f"--output_dir={out}"]) == 0
    return out, (out / "report.md").read_text()


def test_report_numbers_are_the_runs(demo):
    out, report = demo
    results = json.loads((out / "results.json").read_text())
    assert report_markdown(results) == report  # the report follows from results.json alone
    for claim in results["claims"].values():
        diffs = list(claim["per_seed"].values())
        assert claim["verdict"] == judge(diffs if claim["better"] == "lower" else [-d for d in diffs])
    assert (out / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](training.png)" in report
    for seed in (1, 2):
        cells = []
        for name in ("moe", "dense-active", "dense"):
            last = [r for r in read_jsonl(out / f"{name}-seed{seed}" / "logs" / "metrics.jsonl") if "eval/chrf" in r][-1]
            cells.append(f"{last['eval/loss']:.4f} / {last['eval/chrf']:.2f}")
        assert f"| {seed} | " + " | ".join(cells) + " |" in report
    models = {name: AutoModelForSeq2SeqLM.from_pretrained(out / f"{name}-seed1") for name in ("moe", "dense-active", "dense")}
    moe, wide = models["moe"], models["dense-active"]
    router = sum(p.numel() for n, p in moe.named_parameters() if n.endswith(".gate.weight"))
    assert moe.num_active_parameters() - router == wide.num_parameters() < moe.num_parameters()  # equal FLOPs per token
    for name, model in models.items():
        total = model.num_parameters()
        assert f"| {total / 1e6:.3f}M |" in report, name
    for held_out in EVALUATION_FILES:
        assert f"`{held_out}`" in report


def test_builtin_task_is_split_by_file_and_deterministic():
    train, validation = stdlib_pairs(30)
    assert {p["file"] for p in validation} == set(EVALUATION_FILES)
    assert not {p["file"] for p in train} & set(EVALUATION_FILES)
    assert stdlib_pairs.__wrapped__(30) == (train, validation)  # read again from the files: the same pairs
    heapq = file_pairs(stdlib_root() / "heapq.py")
    push = next(p for p in heapq if p["name"] == "heappush")
    assert push["source"].startswith("def heappush(heap, item):") and '"""' not in push["source"]
    assert push["target"] == "Push item onto heap, maintaining the heap invariant."
    assert first_sentence("Return x.  More text.\n\nDetails.") is None  # fewer than 3 words
    assert first_sentence("Return the sum of two\n    numbers. Then more.") == "Return the sum of two numbers."
