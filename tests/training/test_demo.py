"""`hf-ppmoe demo` end to end at a tiny size: every stage runs and the report states what the stages measured."""

import re

from transformers import AutoModelForCausalLM, GPT2LMHeadModel

from hf_ppmoe.cli import main as cli


def test_demo_runs_every_stage(tmp_path, capsys):
    out = tmp_path / "demo"
    flags = ["--dense_steps=4", "--finetune_steps=4", "--batch_size=4", "--block_size=32", "--hidden_size=32",
             "--num_layers=2", "--num_experts=4", "--num_beams=2"]
    assert cli(["demo", f"--output_dir={out}", *flags]) == 0
    printed = capsys.readouterr().out
    assert all(f"[{i}/6]" in printed for i in range(1, 7)), printed

    report = (out / "report.md").read_text()
    gap = float(re.search(r"max \|logit difference\| between the fresh MoE and the dense model = (\S+)\.", report)[1])
    assert gap < 1e-4  # upcycling is exact
    assert "identical to Transformers' beam search: True" in report
    for plot in ("loss.png", "expert_load.png"):
        assert (out / plot).stat().st_size > 0
    assert isinstance(AutoModelForCausalLM.from_pretrained(out / "merged"), GPT2LMHeadModel)  # plain Transformers
    assert AutoModelForCausalLM.from_pretrained(out / "moe").config.model_type == "gpt_moe"
