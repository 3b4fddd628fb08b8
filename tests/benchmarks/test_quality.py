"""benchmarks/quality.py end to end at its smoke setting (2 arms + the upcycling pair, then the balancing arms, 1
seed, 4 steps): the corpus split is by file and disjoint, token counts match the stored streams, the equal-FLOPs and
equal-parameter arms are equal where they claim to be, the upcycled model starts from the dense checkpoint, and a
rerun trains nothing."""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from hf_ppmoe.training.data import train_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location("quality_benchmark", ROOT / "benchmarks" / "quality.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_arms_are_equal_in_active_flops_and_parameters(quality):
    s = quality.SETTINGS["cpu"]
    tokenizer = train_tokenizer(["x = 1\n"], vocab_size=300)
    flops, params = {}, {}
    for arm in quality.ARMS:
        with torch.device("meta"):
            model = quality.build(s, tokenizer, arm, seed=0)
        flops[arm] = quality.flops_per_token(model.config, s.block)
        routers = sum(p.numel() for n, p in model.named_parameters() if ".gate." in n)
        params[arm] = quality.parameters(model)["total"] - routers
    moe_arms = [a for a in quality.ARMS if a not in ("dense", "dense_wide")]
    # every MoE arm: the dense model's FFN and attention FLOPs, plus only its router
    for arm in moe_arms:
        assert flops[arm]["ffn"] == flops["dense"]["ffn"] and flops[arm]["attention"] == flops["dense"]["attention"]
        assert flops[arm]["train"] == flops["dense"]["train"] + 3 * flops[arm]["router"]
        assert 0 < flops[arm]["router"] < 0.02 * flops[arm]["forward"]
    # and the same parameters as the wide dense model (routers aside), 8x the dense model's FFN in those layers
    assert len({params[a] for a in [*moe_arms, "dense_wide"]}) == 1
    assert flops["dense_wide"]["ffn"] > 4 * flops["dense"]["ffn"]


def test_smoke_run_end_to_end_and_resume(quality, tmp_path, monkeypatch):
    results, work = tmp_path / "quality.json", tmp_path / "work"
    args = ["--smoke", "--results", str(results), "--work", str(work), "--threads", "1"]
    assert quality.main(args) == ["dense/0", "switch/0", "upcycle_dense/0", "upcycle_moe/0"]
    data = json.loads(results.read_text())

    folder = next(work.glob("corpus-*"))
    stats = json.loads((folder / "stats.json").read_text())
    train, val = set(stats["train_files"]), set(stats["val_files"])
    assert train and val and not train & val, "split by file, both sides non-empty and disjoint"
    assert train | val == set(quality.stdlib_files()[1][: quality.SETTINGS["smoke"].max_files])
    assert quality.split_files(sorted(train | val)) == (stats["train_files"], stats["val_files"]), "deterministic"
    tokens = torch.load(folder / "tokens.pt")
    assert data["corpus"]["train_tokens"] == len(tokens["train"]) > 0
    assert data["corpus"]["val_tokens"] == len(tokens["val"]) > 0
    assert f"train {len(tokens['train']):,} tokens" in results.with_suffix(".md").read_text()
    assert results.with_suffix(".png").stat().st_size > 10_000

    runs = data["runs"]
    s = quality.SETTINGS["smoke"]
    for record in runs.values():
        steps = [p["step"] for p in record["curve"]]
        assert steps == sorted(set(steps)) and steps[0] == 0 and len(steps) == s.evals + 1
        assert record["val_loss"] == record["curve"][-1]["val_loss"] < record["curve"][0]["val_loss"] + 0.5
        assert record["curve"][-1]["flops"] == record["train_tokens"] * record["flops_per_token"]["train"]
    assert runs["dense/0"]["flops_per_token"]["ffn"] == runs["switch/0"]["flops_per_token"]["ffn"]
    # both continuations start from the dense run's final weights (same validation loss), the MoE with equal logits
    start = [runs[f"{arm}/0"]["curve"][0]["val_loss"] for arm in quality.UPCYCLE_ARMS]
    assert start == pytest.approx([runs["dense/0"]["val_loss"]] * 2, abs=1e-4)
    assert runs["upcycle_moe/0"]["logit_gap"] < 1e-4

    assert quality.main(args) == [], "a rerun finds every run in the results file"
    # the balancing arms keep running; without the dense arm no upcycling pair (it continues the dense arm)
    balancing = ["top2", "top2_seq", "top2_global", "top2_bias", "top2_sigmoid", "top2_sigmoid_bias"]
    assert quality.main([*args, "--arms", *balancing]) == [f"{arm}/0" for arm in balancing]
    runs = json.loads(results.read_text())["runs"]
    loads = [runs[f"{arm}/0"]["curve"][-1]["load_max_over_mean"] for arm in balancing]
    assert all(1.0 <= load <= 16.0 for load in loads), loads  # max/mean over 16 experts: between 1 and E
    results.with_suffix(".md").unlink()
    assert quality.main([*args, "--report"]) == [] and results.with_suffix(".md").exists()
    assert "max/mean load" in results.with_suffix(".md").read_text()
    assert json.loads(results.read_text())["runs"] == runs
    monkeypatch.setitem(quality.SETTINGS, "smoke", dataclasses.replace(s, lr=2 * s.lr))
    with pytest.raises(SystemExit, match="another setting or corpus .*lr"):
        quality.main(args)
