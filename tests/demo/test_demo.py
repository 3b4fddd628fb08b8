"""`hf-ppmoe demo --quick`: every arm and stage runs and results.json holds every field; the arms compared at equal
FLOPs per token are equal in FLOPs (from the configs); all arms of a seed see the same batches; the report's claims
follow results.json (a claim only when every seed agrees beyond twice the spread); the numbers are the models'."""

import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from hf_ppmoe_cli import main as cli
from hf_ppmoe.demo.options import DemoArguments
from hf_ppmoe.demo.protocol import CPU, QUICK, SCRATCH_ARMS, evaluate, flops_per_token, held_out_blocks, windows
from hf_ppmoe.demo.report import judge, report_markdown, sentence
from hf_ppmoe.demo.runs import load_data, run_arm

ARMS = ["dense_scratch", "moe_scratch", "dense_continued", "moe_upcycled"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    assert cli(["demo", "--quick", "--seeds", "2", "--workers", "2", f"--output_dir={out}"]) == 0
    return out, json.loads((out / "results.json").read_text()), (out / "report.md").read_text()


def test_every_arm_runs_and_results_json_has_every_field(demo):
    out, results, report = demo
    assert set(ARMS) <= set(results["arms"])
    for name in ARMS:
        arm = results["arms"][name]
        assert isinstance(arm["params_total"], int) and isinstance(arm["params_active"], int)
        assert arm["params_active"] <= arm["params_total"] and arm["flops_per_token"] > 0 and arm["train_tokens"] > 0
        assert set(arm["held_out_loss"]) == {"0", "1"} and all(isinstance(v, float) for v in arm["held_out_loss"].values())
    protocol = results["protocol"]
    assert protocol["rule"] and protocol["claim_rule"] and protocol["held_out"]["files"] == len(protocol["held_out"]["file_names"])
    assert json.loads((out / "protocol.json").read_text()) == protocol  # written before training, unchanged after
    for plot in ("losses.png", "expert_share.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({plot})" in report
    assert results["upcycling"]["logit_gap"] < 1e-4 and results["generation"]["same"] is True
    assert isinstance(AutoModelForCausalLM.from_pretrained(out / "merged"), LlamaForCausalLM)  # plain Transformers


def test_equal_flops_arms_are_equal_in_flops_from_their_configs(demo):
    out, results, _ = demo
    configs = {a: AutoModelForCausalLM.from_pretrained(out / "models" / f"{a}-seed0").config for a in ARMS}
    parts = {a: flops_per_token(c, QUICK.block) for a, c in configs.items()}
    dense, moe = parts["dense_scratch"], parts["moe_scratch"]
    assert (moe["attention"], moe["ffn"]) == (dense["attention"], dense["ffn"])  # the same work per token ...
    assert dense["router"] == 0 < moe["router"] < 0.02 * dense["train"] / 3  # ... plus the router alone
    assert results["arms"]["moe_scratch"]["flops_per_token"] == moe["train"]
    assert results["arms"]["moe_scratch"]["train_tokens"] == results["arms"]["dense_scratch"]["train_tokens"]
    assert results["arms"]["moe_upcycled"]["train_tokens"] == results["arms"]["dense_continued"]["train_tokens"]
    assert parts["moe_upcycled"]["ffn"] > parts["dense_continued"]["ffn"]  # upcycling: equal tokens, more FLOPs (said so)


def test_all_arms_of_a_seed_see_the_same_batches(demo):
    out, results, _ = demo
    order = {a: results["arms"][a]["data_order"] for a in ARMS}
    for seed in ("0", "1"):
        assert order["dense_scratch"][seed] == order["moe_scratch"][seed]
        assert order["dense_continued"][seed] == order["moe_upcycled"][seed]
    assert order["dense_scratch"]["0"] != order["dense_scratch"]["1"]
    # the hash is of the batches themselves: drawn again as the loop draws them
    data, s = load_data(QUICK, out, None), QUICK
    generator, digest = torch.Generator().manual_seed(1), hashlib.sha1()
    for _ in range(s.steps):
        x = windows(data["train"], torch.randint(len(data["train"]) - s.block, (s.batch,), generator=generator), s.block)
        digest.update(x.numpy().tobytes())
    assert digest.hexdigest() == order["moe_scratch"]["1"]


def test_numbers_are_the_models_and_do_not_depend_on_the_process(demo):
    out, results, _ = demo
    data = load_data(QUICK, out, None)
    model = AutoModelForCausalLM.from_pretrained(out / "models" / "moe_scratch-seed1")
    assert evaluate(model, held_out_blocks(data, QUICK), QUICK) == pytest.approx(results["arms"]["moe_scratch"]["held_out_loss"]["1"], abs=1e-6)
    assert sum(p.numel() for p in model.parameters()) == results["arms"]["moe_scratch"]["params_total"]
    again = run_arm(str(out / "again"), QUICK, None, "moe_scratch", 1)  # in this process, not a worker
    assert again["val_loss"] == pytest.approx(results["arms"]["moe_scratch"]["held_out_loss"]["1"], abs=1e-6)


def test_the_report_states_exactly_the_verdicts_of_results_json(demo):
    _, results, report = demo
    assert list(results["claims"]) == ["from_scratch", "upcycling"]  # the parameter bound only with --parameter_bound
    for claim in results["claims"].values():
        diffs = list(claim["per_seed"].values())
        assert claim["verdict"] == judge(diffs) and sentence(claim) in report
    # change the numbers: the report changes its verdict with them
    edited = json.loads(json.dumps(results))
    edited["claims"]["from_scratch"].update(per_seed={"0": -0.05, "1": -0.052}, mean=-0.051, std=0.0014, verdict="holds")
    assert "**Holds.** moe_scratch minus dense_scratch per seed: -0.0500, -0.0520" in report_markdown(edited)


def test_judge_claims_only_what_every_seed_supports():
    assert judge([-0.02]) == "not shown"  # one seed: no spread
    assert judge([-0.015, -0.02, -0.025]) == "holds"
    assert judge([-0.02, 0.01, -0.01]) == "not shown"  # the seeds disagree
    assert judge([-0.001, -0.03, -0.002]) == "not shown"  # one sign, but the mean is within 2 std of 0
    assert judge([0.01, 0.012]) == "reversed"
    claim = {"arm": "a", "baseline": "b", "per_seed": {"0": -0.001, "1": -0.03, "2": -0.002}, "mean": -0.011, "std": 0.0165,
             "verdict": "not shown"}
    assert "every seed agrees on the sign, but the mean is within twice the spread" in sentence(claim)


@pytest.mark.parametrize("flags, named", [({"seeds": 0}, "--seeds"), ({"workers": -1}, "--workers"),
                                          ({"num_experts_per_tok": 9}, "--num_experts_per_tok"),
                                          ({"hidden_size": 100}, "--hidden_size")])
def test_impossible_flags_are_refused_by_name(flags, named):
    with pytest.raises(ValueError, match=named):
        DemoArguments(**flags)


def test_the_demo_arms_are_quality_benchmark_arms():
    """One experiment: the demo's from-scratch arms are benchmarks/quality.py's `dense`, `top2` and `dense_wide`."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"
    spec = importlib.util.spec_from_file_location("quality_for_demo", path)
    quality = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = quality
    spec.loader.exec_module(quality)
    F = 4 * quality.SETTINGS["cpu"].hidden
    for demo_arm, quality_arm in (("dense_scratch", "dense"), ("moe_scratch", "top2"), ("dense_wide", "dense_wide")):
        assert SCRATCH_ARMS[demo_arm][1](F) == quality.ARMS[quality_arm][1](F)
    assert quality.SETTINGS["cpu"] is CPU  # the demo's setting is the benchmark's
