"""benchmarks/quality.py end to end at its smoke setting (2 arms + the upcycling arm at two budgets, then the
balancing arms, 1 seed, a few steps): the corpus split is by file and disjoint, token counts match the stored streams,
the equal-FLOPs and equal-parameter arms are equal where they claim to be, the upcycled model starts from the dense
run at half the budget, a rerun trains nothing and an interrupted arm goes on from its saved fork, and the budget curve the demo quotes is the results file's."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hf_ppmoe.training.data import train_tokenizer
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quality():
    return load_benchmark("quality")


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
    moe_arms = [a for a in quality.ARMS if a not in ("dense", "dense_wide", "dense_2f")]
    # every MoE arm: the dense model's FFN and attention FLOPs, plus only its router
    for arm in moe_arms:
        assert flops[arm]["ffn"] == flops["dense"]["ffn"] and flops[arm]["attention"] == flops["dense"]["attention"]
        assert flops[arm]["train"] == flops["dense"]["train"] + 3 * flops[arm]["router"]
        assert 0 < flops[arm]["router"] < 0.02 * flops[arm]["forward"]
    # the routing arms: the same parameters as the wide dense model (routers aside), 8x the dense FFN in those layers
    assert len({params[a] for a in [*moe_arms, "dense_wide"] if a != "top2_e4"}) == 1
    assert flops["dense_wide"]["ffn"] > 4 * flops["dense"]["ffn"]
    # the demo's MoE: its experts together are the demo's parameter bound, every FFN twice the dense width
    assert params["top2_e4"] == params["dense_2f"] and flops["dense_2f"]["ffn"] == 2 * flops["dense"]["ffn"]


def test_smoke_run_end_to_end_and_resume(quality, tmp_path, monkeypatch):
    results, work = tmp_path / "quality.json", tmp_path / "work"
    args = ["--smoke", "--results", str(results), "--work", str(work), "--threads", "1", "--budgets", "10", "20"]
    assert quality.main(args) == ["dense/0@10", "upcycle_moe/0@10", "dense/0@20", "upcycle_moe/0@20", "switch/0@10",
                                  "switch/0@20"]
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
    for k, record in runs.items():
        steps = [p["step"] for p in record["curve"]]
        budget = int(k.rsplit("@", 1)[1])
        assert steps == sorted(set(steps)) and steps[0] == 0 and steps[-1] == budget == record["steps"]
        assert record["val_loss"] == record["curve"][-1]["final_loss"] < record["curve"][0]["val_loss"] + 0.5
    assert runs["dense/0@10"]["flops_per_token"]["ffn"] == runs["switch/0@10"]["flops_per_token"]["ffn"]
    # the branch at 10 steps shares the 20-step run's curve until its cool-down, then differs
    short, long = runs["dense/0@10"]["curve"], runs["dense/0@20"]["curve"]
    assert short[:9] == long[:9] and short[-1]["val_loss"] != long[10]["val_loss"]
    # the upcycled run continues the dense run at half the budget: its curve is the dense one's until then, equal logits
    for b in (10, 20):
        up, dense = runs[f"upcycle_moe/0@{b}"], runs[f"dense/0@{b}"]
        assert up["curve"][: b // 2 + 1] == dense["curve"][: b // 2 + 1] and up["logit_gap"] < 1e-4
        assert up["train_tokens"] == dense["train_tokens"] // 2 and up["data_order"] == dense["data_order"]

    assert quality.main(args) == [], "a rerun finds every run in the results file"
    # an arm stopped after its saved fork goes on from it, to the same numbers as the unbroken run
    interrupted = json.loads(results.read_text())
    del interrupted["runs"]["switch/0@20"]
    results.write_text(json.dumps(interrupted))
    with monkeypatch.context() as m:
        m.setattr(quality.Run, "start", classmethod(lambda *a, **k: pytest.fail("the arm started over")))
        assert quality.main([*args, "--arms", "switch"]) == ["switch/0@20"]
    assert json.loads(results.read_text())["runs"]["switch/0@20"]["curve"] == runs["switch/0@20"]["curve"]
    # the balancing arms keep running; without the dense arm no upcycling (it continues the dense run)
    balancing = ["top2", "top2_seq", "top2_global", "top2_bias", "top2_sigmoid", "top2_sigmoid_bias"]
    assert quality.main([*args[:-3], "--arms", *balancing]) == [f"{arm}/0@{s.steps}" for arm in balancing]
    runs = json.loads(results.read_text())["runs"]
    loads = [runs[f"{arm}/0@{s.steps}"]["curve"][-1]["load_max_over_mean"] for arm in balancing]
    assert all(1.0 <= load <= 16.0 for load in loads), loads  # max/mean over 16 experts: between 1 and E
    results.with_suffix(".md").unlink()
    assert quality.main([*args, "--report"]) == [] and results.with_suffix(".md").exists()
    assert "max/mean load" in results.with_suffix(".md").read_text()
    assert json.loads(results.read_text())["runs"] == runs
    monkeypatch.setitem(quality.SETTINGS, "smoke", dataclasses.replace(s, lr=2 * s.lr))
    with pytest.raises(SystemExit, match="another setting or corpus .*lr"):
        quality.main(args)


def test_the_demo_quotes_the_measured_budget_curve(quality):
    """hf_ppmoe.demo.budget.CURVE is `curve_summary` of the committed budget-curve results, for the demo's setting."""
    from hf_ppmoe.demo.budget import CURVE, curve_for

    path = ROOT / "benchmarks" / "results" / "quality_cpu_curve.json"
    if CURVE is None:
        assert not path.exists(), "the curve was measured: copy curve_summary(results) into hf_ppmoe/demo/budget.py"
        return
    assert json.loads(json.dumps(quality.curve_summary(json.loads(path.read_text())))) == CURVE
    assert curve_for(quality.SETTINGS["cpu"]) is CURVE
