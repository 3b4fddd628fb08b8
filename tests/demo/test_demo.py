"""`hf-ppmoe demo --quick`: every arm and stage runs and results.json holds every field; the arms compared at equal
FLOPs per token are equal in FLOPs (from the configs); all arms of a seed see the same batches; a saved run continues
exactly as an unbroken one, so the demo's split dense run, quality.py's budget branches and `--tokens` agree to the
last digit; the schedule is Transformers' WSD; upcycling copies the optimizer state; the report's claims follow
results.json (a claim only when every seed agrees beyond twice the spread) and quote the budget curve."""

import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.optimization import get_wsd_schedule

from hf_ppmoe_cli import main as cli
from hf_ppmoe.demo.budget import curve_for
from hf_ppmoe.demo.gpt import setting_of
from hf_ppmoe.demo.loop import Run, cooldown_start, evaluate, held_out_blocks, learning_rate, train, windows
from hf_ppmoe.demo.options import DemoArguments
from hf_ppmoe.demo.protocol import CPU, QUICK, SCRATCH_ARMS, build, check_blocks, flops_per_token, upcycle_run
from hf_ppmoe.demo.report import budget_sentence, claims, judge, report_markdown, sentence
from hf_ppmoe.demo.runs import load_data, run_job
from helpers import load_benchmark

ARMS = ["dense", "moe_scratch", "moe_upcycled"]

@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    assert cli(["demo", "--quick", "--seeds", "2", "--workers", "2", f"--output_dir={out}"]) == 0
    return out, json.loads((out / "results.json").read_text()), (out / "report.md").read_text()


@pytest.fixture
def one_thread():
    """The demo's workers run one thread each; in-process runs compared with theirs to the last digit do too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def quality():
    return load_benchmark("quality")


def test_every_arm_runs_and_results_json_has_every_field(demo):
    out, results, report = demo
    assert set(ARMS) == set(results["arms"])  # the parameter bound only with --parameter_bound
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
    assert results["run_time_min"] > 0 and set(results["stages_s"]) == {"data", "training", "speed, shares, generation, merging"}


def test_equal_flops_arms_are_equal_in_flops_from_their_configs(demo):
    out, results, _ = demo
    configs = {a: AutoModelForCausalLM.from_pretrained(out / "models" / f"{a}-seed0").config for a in ARMS}
    parts = {a: flops_per_token(c, QUICK.block) for a, c in configs.items()}
    dense, moe = parts["dense"], parts["moe_scratch"]
    assert (moe["attention"], moe["ffn"]) == (dense["attention"], dense["ffn"])  # the same work per token ...
    assert dense["router"] == 0 < moe["router"] < 0.02 * dense["train"] / 3  # ... plus the router alone
    assert configs["moe_scratch"].num_experts == 4 and all(configs["moe_scratch"].is_moe_layer(i) for i in range(2))
    assert results["arms"]["moe_scratch"]["flops_per_token"] == moe["train"]
    arms = results["arms"]
    assert arms["moe_scratch"]["train_tokens"] == arms["dense"]["train_tokens"] == QUICK.tokens()
    assert arms["moe_upcycled"]["train_tokens"] == QUICK.tokens() // 2 == arms["moe_upcycled"]["start_tokens"]
    assert parts["moe_upcycled"]["ffn"] > parts["dense"]["ffn"]  # upcycling: equal tokens, more FLOPs (said so)


def test_all_arms_of_a_seed_see_the_same_batches(demo):
    out, results, _ = demo
    order = {a: results["arms"][a]["data_order"] for a in ARMS}
    for seed in ("0", "1"):
        assert order["dense"][seed] == order["moe_scratch"][seed] == order["moe_upcycled"][seed]
    assert order["dense"]["0"] != order["dense"]["1"]
    # the chain is of the batches themselves: drawn again as the loop draws them
    data, s = load_data(QUICK, out), QUICK
    generator, chain = torch.Generator().manual_seed(1), ""
    for _ in range(s.steps):
        x = windows(data["train"], torch.randint(len(data["train"]) - s.block, (s.batch,), generator=generator), s.block)
        chain = hashlib.sha1(chain.encode() + x.numpy().tobytes()).hexdigest()
    assert chain == order["moe_scratch"]["1"]


def test_numbers_are_the_models_and_do_not_depend_on_the_process(demo, one_thread):
    out, results, _ = demo
    data = load_data(QUICK, out)
    model = AutoModelForCausalLM.from_pretrained(out / "models" / "moe_scratch-seed1")
    loss = results["arms"]["moe_scratch"]["held_out_loss"]["1"]
    assert evaluate(model, held_out_blocks(data, QUICK, QUICK.final_blocks), QUICK) == pytest.approx(loss, abs=1e-6)
    assert sum(p.numel() for p in model.parameters()) == results["arms"]["moe_scratch"]["params_total"]
    again = run_job(str(out / "again"), QUICK, "moe_scratch", 1)  # in this process, not a worker
    assert again["val_loss"] == loss


def test_a_saved_run_continues_exactly_and_budgets_branch_exactly(demo, quality, tmp_path, one_thread):
    """The demo's dense runs (saved at B / 2, resumed in another process) and upcycled runs equal quality.py's
    unbroken runs, and quality.py's branch at budget B of a 2B run equals the demo at --tokens B: to the last digit."""
    out, results, _ = demo
    quality.run_all(QUICK, "quick", tmp_path / "q.json", out, [0], ["dense", "top2_e4"], [QUICK.steps, 2 * QUICK.steps],
                    verbose=False)
    runs = json.loads((tmp_path / "q.json").read_text())["runs"]
    for demo_arm, arm in (("dense", "dense"), ("moe_scratch", "top2_e4"), ("moe_upcycled", "upcycle_moe")):
        record = json.loads((out / "runs" / f"{demo_arm}-seed0.json").read_text())
        branch = runs[f"{arm}/0@{QUICK.steps}"]
        assert branch["val_loss"] == record["val_loss"] and branch["data_order"] == record["data_order"]
        assert [p["val_loss"] for p in branch["curve"]] == [p["val_loss"] for p in record["curve"]]
    s = setting_of(DemoArguments(quick=True, tokens=QUICK.tokens(2 * QUICK.steps)))
    assert s.steps == 2 * QUICK.steps
    assert run_job(str(tmp_path / "longer"), s, "moe_scratch", 0)["val_loss"] == runs[f"top2_e4/0@{s.steps}"]["val_loss"]


def test_the_schedule_is_transformers_wsd():
    s = CPU
    for steps in (500, 1000):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=s.lr)
        start = cooldown_start(s, steps)
        schedule = get_wsd_schedule(optimizer, s.warmup, steps - start, num_stable_steps=start - s.warmup,
                                    decay_type="1-sqrt")
        reference = [s.lr * schedule.lr_lambdas[0](step) for step in range(steps)]
        assert [learning_rate(s, step, steps) for step in range(steps)] == pytest.approx(reference, rel=1e-12, abs=1e-15)
    # a 500-step run and a 1000-step run share every rate before the shorter one's cool-down
    assert all(learning_rate(s, t, 500) == learning_rate(s, t, 1000) for t in range(cooldown_start(s, 500)))


def test_upcycling_copies_the_optimizer_state(demo, one_thread):
    out, _, _ = demo
    data, s = load_data(QUICK, out), QUICK
    run = Run.start(build(s, data["tokenizer"], SCRATCH_ARMS["dense"][1], 0), s, 0)
    train(run, data, s, s.steps // 2, s.steps)
    moe, gap = upcycle_run(run, s, 0, check_blocks(data, s))
    assert gap < 1e-4 and moe.step == run.step and moe.data_order == run.data_order
    dense_state = {n: run.optimizer.state[p] for n, p in run.model.named_parameters()}
    state = {n: moe.optimizer.state.get(p) for n, p in moe.model.named_parameters()}
    layer = "model.layers.1.mlp"
    assert state[f"{layer}.gate.weight"] is None  # the router starts without state
    for key in ("exp_avg", "exp_avg_sq"):
        gate_up, down = state[f"{layer}.experts.gate_up_proj"][key], state[f"{layer}.experts.down_proj"][key]
        for e in range(gate_up.shape[0]):  # every expert holds the dense FFN's moments, as it holds its weights
            assert torch.equal(gate_up[e], torch.cat([dense_state[f"{layer}.gate_proj.weight"][key],
                                                      dense_state[f"{layer}.up_proj.weight"][key]]))
            assert torch.equal(down[e], dense_state[f"{layer}.down_proj.weight"][key])
        assert torch.equal(state["model.layers.0.mlp.gate_proj.weight"][key], dense_state["model.layers.0.mlp.gate_proj.weight"][key])
    assert state[f"{layer}.experts.down_proj"]["step"] == dense_state[f"{layer}.down_proj.weight"]["step"] == s.steps // 2


def test_the_report_states_exactly_the_verdicts_of_results_json(demo):
    _, results, report = demo
    assert report_markdown(results) == report  # rendered from results.json alone
    assert list(results["claims"]) == ["from_scratch", "upcycling"]
    for claim in results["claims"].values():
        diffs = list(claim["per_seed"].values())
        assert claim["verdict"] == judge(diffs) and sentence(claim) in report
        assert claim["agree"] == sum(d < 0 for d in diffs) and claim["better"] == "lower"
    # change the numbers: the report changes its verdict with them
    edited = json.loads(json.dumps(results))
    edited["claims"]["from_scratch"].update(per_seed={"0": -0.05, "1": -0.052}, mean=-0.051, std=0.0014, agree=2,
                                           verdict="holds")
    assert "**Holds.** moe_scratch minus dense per seed: -0.0500, -0.0520" in report_markdown(edited)


def test_the_report_quotes_the_budget_curve():
    # per budget: the verdict over all 5 seeds, and how many of the 10 sets of 3 (a demo's seeds) it holds for
    points = [{"tokens": t, "per_seed": {str(i): d - 0.005 * i for i in range(5)}, "mean": d - 0.01, "std": 0.008,
               "agree": 5 if d < 0 else 2, "verdict": v, "subsets": {"size": 3, "holds": h, "of": 10}}
              for t, d, v, h in ((1_000, 0.005, "not shown", 0), (2_000, -0.01, "holds", 7), (4_000, -0.03, "holds", 10),
                                 (8_000, -0.05, "holds", 10))]
    curve = {"setting": QUICK.compatible(), "seeds": [0, 1, 2, 3, 4], "claims": {"from_scratch": points}}
    arms = {a: {"held_out_loss": {"0": 4.0, "1": 4.1, "2": 4.2}} for a in ("dense", "moe_scratch", "moe_upcycled")}
    verdicts = claims(arms, 2_000, curve)
    assert verdicts["from_scratch"]["curve"]["clears_at"] == 4_000  # all 5 hold at 2,000, but not every 3 of them
    assert verdicts["from_scratch"]["curve"]["here"]["tokens"] == 2_000
    said = budget_sentence(verdicts["from_scratch"])
    assert "lower in 5 of 5" in said and "the rule holds for 7 of the 10 sets of 3" in said
    assert "every set of 3 clears it: `hf-ppmoe demo --tokens 4000`" in said
    assert "Any 3 seeds should clear it here" in budget_sentence(claims(arms, 4_000, curve)["from_scratch"])
    assert "curve" not in verdicts["upcycling"] and "No budget curve" in budget_sentence(verdicts["upcycling"])
    points[2]["subsets"]["holds"] = 9  # a budget where every set holds below one where one does not: "from" the last
    assert claims(arms, 2_000, curve)["from_scratch"]["curve"]["clears_at"] == 8_000
    points[3]["subsets"]["holds"] = 9
    said = budget_sentence(claims(arms, 2_000, curve)["from_scratch"])
    assert "No budget it measured (up to 0.01M tokens per run) clears" in said and "the most sets hold at 0.00M (9 of 10)" in said
    assert "The arm ends lower in 17 of the curve's 20 runs" in said
    assert curve_for(QUICK) is None  # the curve stored with the package was measured for the CPU setting only


def test_judge_claims_only_what_every_seed_supports():
    assert judge([-0.02]) == "not shown"  # one seed: no spread
    assert judge([-0.015, -0.02, -0.025]) == "holds"
    assert judge([-0.02, 0.01, -0.01]) == "not shown"  # the seeds disagree
    assert judge([-0.001, -0.03, -0.002]) == "not shown"  # one sign, but the mean is within 2 std of 0
    assert judge([0.01, 0.012]) == "reversed"
    claim = {"arm": "a", "baseline": "b", "per_seed": {"0": -0.001, "1": -0.03, "2": -0.002}, "mean": -0.011,
             "std": 0.0165, "better": "lower", "unit": "nats", "agree": 3, "verdict": "not shown"}
    assert "every seed agrees on the sign, but the mean is within twice the spread" in sentence(claim)


@pytest.mark.parametrize("flags, named", [({"seeds": 0}, "--seeds"), ({"workers": -1}, "--workers"),
                                          ({"num_experts_per_tok": 9}, "--num_experts_per_tok"),
                                          ({"hidden_size": 100}, "--hidden_size"), ({"tokens": -1}, "--tokens")])
def test_impossible_flags_are_refused_by_name(flags, named):
    with pytest.raises(ValueError, match=named):
        DemoArguments(**flags)


def test_the_demo_arms_are_quality_benchmark_arms(quality):
    """One experiment: the demo's from-scratch arms are benchmarks/quality.py's `dense`, `top2_e4` and `dense_2f`."""
    F = 4 * quality.SETTINGS["cpu"].hidden
    for demo_arm, quality_arm in (("dense", "dense"), ("moe_scratch", "top2_e4"), ("dense_wide", "dense_2f")):
        assert SCRATCH_ARMS[demo_arm][1](F) == quality.ARMS[quality_arm][1](F)
    assert quality.SETTINGS["cpu"] is CPU  # the demo's setting is the benchmark's
