"""`hf-ppmoe upcycle|merge|import SRC OUT`: in-process through `main`, and once as a real command."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from converters import SAMPLE_TEXTS, assert_same_outputs, assert_same_seq2seq_outputs, read_tensors, tiny_switch
from transformers import AutoModelForCausalLM

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe_cli import main


def test_upcycle_then_merge_round_trip(dense, tmp_path):
    model, folder = dense("gpt2")
    args = ["--num_experts", "4", "--router_type", "switch", "--moe_layers", "0", "1", "--max_shard_size", "30KB"]
    assert main(["upcycle", str(folder), str(tmp_path / "moe"), *args]) == 0
    moe = GPTMoEForCausalLM.from_pretrained(tmp_path / "moe")
    assert moe.config.router_type == "switch" and all(layer.is_moe for layer in moe.model.layers)
    assert len(list((tmp_path / "moe").glob("model-*-of-*.safetensors"))) > 1
    assert_same_outputs(model, moe)

    assert main(["merge", str(tmp_path / "moe"), str(tmp_path / "dense")]) == 0
    original, merged = read_tensors(folder), read_tensors(tmp_path / "dense")
    assert merged.keys() == original.keys() and all(torch.equal(merged[k], v) for k, v in original.items())


def test_hidden_router_and_usage_merge_from_a_file(dense, tmp_path):
    model, folder = dense("llama")
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(SAMPLE_TEXTS) + "\n")
    assert main(["upcycle", str(folder), str(tmp_path / "moe"), "--num_experts", "4", "--router_init", "hidden",
                 "--sample_file", str(texts)]) == 0
    moe = GPTMoEForCausalLM.from_pretrained(tmp_path / "moe")
    torch.testing.assert_close(moe.model.layers[1].mlp.gate.weight.norm(dim=-1), torch.ones(4))
    assert_same_outputs(model, moe)
    assert main(["merge", str(tmp_path / "moe"), str(tmp_path / "dense"), "--method", "usage", "--sample_file", str(texts)]) == 0
    assert_same_outputs(model, AutoModelForCausalLM.from_pretrained(tmp_path / "dense"))


def test_import_mixtral(dense, tmp_path):
    mixtral, folder = dense("mixtral")
    assert main(["import", str(folder), str(tmp_path / "moe")]) == 0
    assert_same_outputs(mixtral, GPTMoEForCausalLM.from_pretrained(tmp_path / "moe"))


def test_t5_upcycle_per_stack_then_merge(dense, tmp_path):
    t5, folder = dense("t5-v1.1")
    args = ["--num_experts", "4", "--router_type", "gshard", "--encoder_moe_layers", "0", "2", "--no_decoder_moe"]
    assert main(["upcycle", str(folder), str(tmp_path / "moe"), *args]) == 0
    moe = Seq2SeqMoEForConditionalGeneration.from_pretrained(tmp_path / "moe")
    assert [layer.is_moe for layer in moe.model.encoder.layers] == [True, False, True]
    assert not any(layer.is_moe for layer in moe.model.decoder.layers)
    assert_same_seq2seq_outputs(t5, moe)

    assert main(["merge", str(tmp_path / "moe"), str(tmp_path / "dense")]) == 0
    original, merged = read_tensors(folder), read_tensors(tmp_path / "dense")
    assert merged.keys() == original.keys() and all(torch.equal(merged[k], v) for k, v in original.items())


def test_import_switch_transformers(tmp_path):
    switch = tiny_switch()
    switch.save_pretrained(tmp_path / "switch")
    assert main(["import", str(tmp_path / "switch"), str(tmp_path / "moe")]) == 0
    assert_same_seq2seq_outputs(switch, Seq2SeqMoEForConditionalGeneration.from_pretrained(tmp_path / "moe"))


def test_errors_are_reported_not_raised(dense, tmp_path, capsys):
    _, folder = dense("mixtral")
    assert main(["upcycle", str(folder), str(tmp_path / "out")]) == 2
    assert "use import_moe" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_real_command_prints_no_progress_bar_for_a_tiny_conversion(dense, tmp_path):
    """Issue 38: progress bars only where a write takes long enough to watch (ours appears after 3 s; Transformers'
    per-shard loading and writing bars are off in conversions)."""
    model, folder = dense("mistral")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "hf_ppmoe_cli", "upcycle", str(folder), str(tmp_path / "moe"), "--num_experts", "2"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"wrote {tmp_path / 'moe'}" in result.stdout
    assert not any(bar in result.stderr for bar in ("writing tensors", "Loading weights", "Writing model shards")), result.stderr
    assert_same_outputs(model, GPTMoEForCausalLM.from_pretrained(tmp_path / "moe"))


def test_one_command_for_everything(tmp_path, capsys):
    """`hf-ppmoe` lists and runs training and the Megatron converter too; --version; refusals are one line, exit 2."""
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hf-ppmoe {version('hf-ppmoe')}"
    assert main(["--help"]) == 0
    listing = capsys.readouterr().out  # asked-for help goes to stdout
    assert all(f"  {name} " in listing for name in ("demo", "train", "upcycle", "merge", "import", "megatron"))
    with pytest.raises(SystemExit) as exit:  # a path refused by utils.paths: argparse's exit, before any work
        main(["train", "--train_file", str(tmp_path / "missing.txt"), "--output_dir", str(tmp_path)])
    assert exit.value.code == 2
    assert "error: --train_file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:  # argparse's own exit, as for its usage errors
        main(["megatron", "to-hf", str(tmp_path / "none"), str(tmp_path / "out"), "--config", str(tmp_path / "none")])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-ppmoe megatron to-hf: error:") and "Traceback" not in err


@pytest.mark.parametrize("command", ["demo", "train", "upcycle", "merge", "import", "export"])
def test_every_command_refuses_an_unknown_flag_in_one_line(command, capsys):
    args = [] if command in ("demo", "train") else ["src", "out", *(["--to", "mixtral"] if command == "export" else [])]
    with pytest.raises(SystemExit) as exit:
        main([command, *args, "--no_such_flag", "1"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"hf-ppmoe {command}: error: unrecognized arguments: --no_such_flag 1"
    assert "Traceback" not in err and len(err.splitlines()) == 2  # the short usage line, then the error


def test_help_matches_behaviour(capsys):
    """SRC and OUT are positional in help as on the command line; a `--no_X` flag says what it does; no command's
    help mentions options it does not have."""
    with pytest.raises(SystemExit):
        main(["upcycle", "--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: hf-ppmoe upcycle SRC OUT [options]")
    assert "positional arguments:\n  SRC " in text and "--source" not in text and "--output" not in text
    no_flag = text[text.index("--no_norm_topk_prob"):].split("\n  --")[0]
    assert "Turn off --norm_topk_prob (on by default)." in no_flag and "(default:" not in no_flag
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    demo_help = capsys.readouterr().out
    for advertised in re.findall(r"hf-ppmoe demo (--\w+)", Path(main.__globals__["__file__"]).read_text()):
        assert advertised in demo_help, f"cli.py's docstring advertises {advertised}, which demo does not take"


def test_refusals_exit_2_and_missing_positionals_are_argparse_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["upcycle", str(tmp_path)])
    assert exit.value.code == 2 and "the following arguments are required: OUT" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:  # a missing SRC: utils.paths, argparse's exit
        main(["merge", str(tmp_path / "missing"), str(tmp_path / "out")])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-ppmoe merge: error:") and "Traceback" not in err and not (tmp_path / "out").exists()


def test_the_commands_gate_checks_are_the_gates_own():
    """Issue 46: `hf-ppmoe upcycle|train` check --router_type, --num_experts and --num_experts_per_tok in flag words
    before torch is imported (`choices.routing_problem`), with the built-in gates' rules written there again; they
    refuse exactly what the gates' own checks (the model config) refuse."""
    from hf_ppmoe import GPTMoEConfig
    from hf_ppmoe.conversion.choices import BUILTIN_GATES, default_experts_per_token, routing_problem
    from hf_ppmoe.moe.gates import GATES

    assert {name for name, gate in GATES.items() if gate.__module__ == "hf_ppmoe.moe.gates"} == set(BUILTIN_GATES)
    for gate in BUILTIN_GATES:
        for experts in range(1, 9):
            for k in (None, *range(0, 10)):
                try:
                    GPTMoEConfig(num_experts=experts, num_experts_per_tok=default_experts_per_token(gate, k), router_type=gate)
                    refused = False
                except ValueError:
                    refused = True
                assert (routing_problem(gate, experts, k) is not None) == refused, (gate, experts, k)
    assert routing_problem("topp", 4, None).endswith("did you mean --router_type topk?")
