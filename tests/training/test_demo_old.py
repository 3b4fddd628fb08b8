"""`hf-ppmoe demo --quick`: every stage runs, the report has its sections and plots, and every number the report
states is the one in the run's logs and models."""

import json
import re
import statistics

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

from hf_ppmoe_cli import main as cli
from hf_ppmoe.training.data import pack
from hf_ppmoe.training.demo import QUICK, DemoArguments, _lm_loss, _verdict, expert_shares
from hf_ppmoe.training.tracking import read_jsonl

SECTIONS = ["## Data", "## Models", "## Dense pre-training, then fine-tuning both models", "## Where the tokens go",
            "## Generation", "## Merging back into GPT-2", "## Run time"]


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in the report"
    return float(match[1].replace(",", ""))


def _final_eval(records: list[dict]) -> float:
    return [r["eval/loss"] for r in records if "eval/loss" in r][-1]


def _texts(path):
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    assert cli(["demo", "--quick", f"--output_dir={out}"]) == 0
    return out, " ".join((out / "report.md").read_text().split())  # markdown line breaks as spaces


def test_every_stage_section_and_plot(demo, capsys):
    out, report = demo
    positions = [report.find(s) for s in SECTIONS]
    assert -1 not in positions and positions == sorted(positions), positions
    for plot in ("training.png", "expert_share.png"):
        assert f"]({plot})" in report
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _number(r"max \|logit difference\| between the fresh MoE and the dense model\s+on \d+ held-out blocks = (\S+) ", report) < 1e-4
    assert "Identical to Transformers' beam search: True" in report
    assert "a router per MoE layer: gate `topk`" in report and "The router starts random" in report  # issue 31
    assert isinstance(AutoModelForCausalLM.from_pretrained(out / "merged"), GPT2LMHeadModel)  # plain Transformers
    # the held-out topics are named in the report and none of them is in the training data
    held, train = _texts(out / "data" / "held-out.jsonl"), _texts(out / "data" / "train.jsonl")
    assert len(held) == len(re.findall(r"`[a-z][a-z-]*`", report.split("## Models")[0])) and not set(held) & set(train)


def test_report_numbers_are_the_logs(demo):
    out, report = demo
    seeds = [1 + i for i in range(QUICK["seeds"])]
    logged = {}
    for seed in seeds:
        for name in ("moe", "dense"):
            records = read_jsonl(out / "finetune" / f"{name}-seed{seed}" / "logs" / "metrics.jsonl")
            logged[name, seed] = records
        moe, dense = (_final_eval(logged[n, seed]) for n in ("moe", "dense"))
        assert f"| {seed} | {moe:.4f} | {dense:.4f} | {moe - dense:+.4f} |" in report
    diffs = [_final_eval(logged["moe", s]) - _final_eval(logged["dense", s]) for s in seeds]
    assert _verdict(diffs) in report
    # the papers' comparison: a dense GPT-2 with the MoE's active parameters, trained from scratch as many steps
    flops = [_final_eval(read_jsonl(out / "equal-flops" / f"dense-seed{s}" / "logs" / "metrics.jsonl")) for s in seeds]
    for seed, (m, d) in zip(seeds, zip((_final_eval(logged["moe", s]) for s in seeds), flops)):
        assert f"| {seed} | {m:.4f} | {d:.4f} | {m - d:+.4f} |" in report
    assert _verdict([_final_eval(logged["moe", s]) - d for s, d in zip(seeds, flops)]) in report
    wide = AutoModelForCausalLM.from_pretrained(out / "equal-flops" / "dense-seed1")
    moe_init = AutoModelForCausalLM.from_pretrained(out / "moe-init")
    router = sum(p.numel() for n, p in moe_init.named_parameters() if n.endswith(".gate.weight"))
    assert abs(wide.num_parameters() - (moe_init.num_active_parameters() - router)) <= QUICK["num_layers"] * QUICK["hidden_size"]

    for name, label in (("moe", "MoE"), ("dense", "dense")):  # median step, each run's first step left out
        speeds = [v for s in seeds for v in [r["train/tokens_per_second"] for r in logged[name, s] if "train/tokens_per_second" in r][1:]]
        assert f"{label} {statistics.median(speeds):,.0f} tokens/s" in report

    moe = AutoModelForCausalLM.from_pretrained(out / "moe-init")
    dense = AutoModelForCausalLM.from_pretrained(out / "dense")
    total, active = moe.num_parameters(), moe.num_active_parameters()
    assert active < total
    assert f"| {total / 1e6:.2f}M ({total / dense.num_parameters():.2f}x) | {active / 1e6:.2f}M ({active / dense.num_parameters():.2f}x) |" in report

    # one held-out set everywhere: the reloaded models' loss on it is what the training loop logged / the report says
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer")
    blocks = pack(_texts(out / "data" / "held-out.jsonl"), tokenizer, QUICK["block_size"])
    tuned = AutoModelForCausalLM.from_pretrained(out / "finetune" / "moe-seed1").eval()
    assert _lm_loss(tuned, blocks, QUICK["batch_size"]) == pytest.approx(_final_eval(logged["moe", 1]), abs=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    assert _number(r"held-out\s+loss (\d+\.\d+), against", report) == pytest.approx(_lm_loss(merged, blocks, QUICK["batch_size"]), abs=1e-4)

    shares = expert_shares(tuned, blocks, QUICK["batch_size"])
    assert all(sum(row) == pytest.approx(1.0) for row in shares.values())
    low, high = min(min(r) for r in shares.values()), max(max(r) for r in shares.values())
    assert f"after fine-tuning: {100 * low:.1f}% to {100 * high:.1f}%" in report


def test_verdict_claims_only_what_the_seeds_support():
    assert "no difference is claimed" in _verdict([-0.02])
    assert "lower in every seed, by 0.0150 to 0.0250" in _verdict([-0.015, -0.02, -0.025])
    assert "within the spread of the seeds at this size, so none is claimed" in _verdict([-0.02, 0.01, -0.01])
    assert "none is claimed" in _verdict([-0.001, -0.03, -0.002])  # one sign, but the mean is within 2 std of 0
    assert "the dense model ends lower in every seed" in _verdict([0.01, 0.012])


@pytest.mark.parametrize("flags, named", [({"seeds": 0}, "--seeds"), ({"num_experts_per_tok": 9}, "--num_experts_per_tok"),
                                          ({"hidden_size": 100}, "--hidden_size"), ({"moe_layer_frequency": 5}, "--moe_layer_frequency")])
def test_impossible_sizes_are_refused_by_name(flags, named):
    with pytest.raises(ValueError, match=named):
        DemoArguments(**flags)


def test_generation_sample_does_not_loop(demo):
    """The report's sample (flat beam search from the prompt) repeats no 3 tokens and is more than whitespace: it used
    to be the prompt and 29 newlines while the report said a repetition penalty kept it from looping."""
    import ast

    from hf_ppmoe.training.demo import PROMPT

    out, report = demo
    text = ast.literal_eval(re.search(r"> ('.*?'|\".*?\") Identical", report)[1])
    continuation = text[len(PROMPT):]
    assert text.startswith(PROMPT) and continuation.strip()
    ids = AutoTokenizer.from_pretrained(out / "tokenizer")(continuation)["input_ids"]
    trigrams = [tuple(ids[i : i + 3]) for i in range(len(ids) - 2)]
    assert len(trigrams) > 3 and len(set(trigrams)) == len(trigrams)
