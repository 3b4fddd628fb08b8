"""Issue 25, the `hf-ppmoe` command as a new user meets it: every refusal is one `hf-ppmoe COMMAND: error: ...` line
with exit code 2, checked before any work (the source is not read, nothing is trained); `hf-ppmoe --help` imports
neither torch nor Transformers nor hf_ppmoe and prints to stdout."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from hf_ppmoe_cli import main

ROOT = Path(__file__).parents[2]


def _refusal(capsys, argv) -> str:
    """The error line of a refused command (argparse's exit 2, or a returned 2); nothing else on stderr but the
    short usage line."""
    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) <= 2, err
    line = err.splitlines()[-1]
    prog = " ".join(argv[:2]) if argv[0] == "megatron" else argv[0]  # hf-ppmoe megatron to-megatron: error: ...
    assert line.startswith(f"hf-ppmoe {prog}: error: "), err
    return line


def test_help_and_version_import_nothing_heavy_and_help_goes_to_stdout():
    code = (
        "import sys, hf_ppmoe_cli\n"
        "assert hf_ppmoe_cli.main(['--help']) == 0\n"
        "assert hf_ppmoe_cli.main(['--version']) == 0\n"
        "print(sorted(m for m in ('torch', 'transformers', 'hf_ppmoe') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: hf-ppmoe COMMAND") and result.stderr == ""
    assert result.stdout.splitlines()[-1] == "[]"
    # the installed command is this launcher
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["hf-ppmoe"] == "hf_ppmoe_cli:main"


def test_an_unknown_command_is_an_error_line_with_the_closest_command(capsys):
    assert main(["upcylce"]) == 2
    assert capsys.readouterr().err.splitlines() == ["usage: hf-ppmoe COMMAND [--help] | hf-ppmoe --version",
                                                    "hf-ppmoe: error: unknown command 'upcylce'; did you mean 'hf-ppmoe upcycle'?"]
    assert main(["frobnicate"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("hf-ppmoe: error: unknown command 'frobnicate'; the commands: demo,")


def test_upcycle_settings_are_refused_before_the_source_is_read(tmp_path, capsys):
    missing = str(tmp_path / "no-such-source")  # read first, it would be the error
    out = tmp_path / "out"
    line = _refusal(capsys, ["upcycle", missing, str(out), "--num_experts", "2", "--num_experts_per_tok", "3"])
    assert "--num_experts_per_tok 3 is more than --num_experts 2" in line
    assert "--router_type foo: no such gate" in _refusal(capsys, ["upcycle", missing, str(out), "--router_type", "foo"])
    line = _refusal(capsys, ["upcycle", missing, str(out), "--max_shard_size", "LOTS"])
    assert "max_shard_size 'LOTS': give a size such as 5GB" in line
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = _refusal(capsys, ["upcycle", missing, str(out)])
    assert line.endswith(f"{out} already exists; choose a new output folder or pass --overwrite.")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_settings_the_result_refuses_given_a_source_are_a_conversion_error(tmp_path, capsys):
    dense = tmp_path / "dense"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(dense)
    capsys.readouterr()
    line = _refusal(capsys, ["upcycle", str(dense), str(tmp_path / "out"), "--moe_layers", "5"])
    assert "refuses a setting" in line and "moe_layers" in line, line
    assert not (tmp_path / "out").exists()


def test_demo_values_are_one_line(capsys):
    assert _refusal(capsys, ["demo", "--num_experts", "0"]).endswith("--num_experts must be >= 1, got 0.")


def test_train_refuses_a_missing_model_folder(tmp_path, capsys):
    line = _refusal(capsys, ["train", "--model_name_or_path", "./nope", "--output_dir", str(tmp_path / "run")])
    assert "--model_name_or_path ./nope: no such folder" in line
    assert not (tmp_path / "run").exists()


def test_push_to_hub_without_a_login_is_refused_before_training(tmp_path, capsys, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    asked = []

    def no_login(*args, **kwargs):
        asked.append(True)
        raise huggingface_hub.errors.LocalTokenNotFoundError("Token is required,\nbut no token found.")

    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", no_login)
    argv = ["train", "--push_to_hub", "--output_dir", str(tmp_path / "run"), "--max_steps", "1"]
    line = _refusal(capsys, argv)
    assert asked and "--push_to_hub was given but the Hub cannot be reached" in line and "hf auth login" in line
    assert "no token found" in line  # the reason, on the same line
    assert not (tmp_path / "run").exists()  # nothing trained

    from hf_ppmoe.training import TrainArguments

    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", lambda *a, **k: {"name": "someone"})
    TrainArguments(push_to_hub=True).validate()  # logged in: accepted


@pytest.mark.parametrize("size, expected", [("5GB", 5 * 10**9), ("2GiB", 2 * 2**30), ("1000", 1000), (" 1.5mb", 1_500_000)])
def test_shard_sizes_that_are_read(size, expected):
    from hf_ppmoe.conversion.io import parse_size

    assert parse_size(size) == expected
    for bad in ("LOTS", "-1GB", "0", "GB", "infGB"):
        with pytest.raises(ValueError, match="give a size such as"):
            parse_size(bad)


# ---- issue 38: every command's realistic mistakes, in the command's own words (flags, commands, defaults) ----


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny dense GPT-2 and its 4-expert upcycle; copies with their weights cut short: the MoE without its
    checksums.sha256 and with it, and the dense model (which has none)."""
    import shutil

    from hf_ppmoe.conversion import upcycle

    root = tmp_path_factory.mktemp("mistakes")
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(root / "dense")
    upcycle(root / "dense", num_experts=4, save_directory=root / "moe")
    for name, keep_checksums in (("cut", False), ("cut-checked", True), ("dense-cut", True)):
        shutil.copytree(root / ("dense" if name == "dense-cut" else "moe"), root / name)
        if not keep_checksums and (root / name / "checksums.sha256").exists():
            (root / name / "checksums.sha256").unlink()
        with open(root / name / "model.safetensors", "r+b") as f:
            f.truncate(4000)
    return root


def _mistakes(t):
    """(argv, words the error line must hold, words it must not) for every command."""
    dense, moe, out = str(t / "dense"), str(t / "moe"), str(t / "out")
    return [
        (["merge", moe, out, "--method", "average"], ["--method", "invalid choice: 'average'", "mean"], []),
        (["merge", dense, out], ["'gpt2' model", "hf-ppmoe import"], []),
        (["merge", moe, out, "--method", "usage"], ["--method usage needs --sample_file"], ["sample_texts"]),
        (["upcycle", dense, out, "--router_init", "hidden"], ["--router_init hidden needs --sample_file"], ["sample_texts"]),
        (["upcycle", dense, out, "--router_init", "learned"], ["--router_init", "invalid choice"], []),
        (["upcycle", dense, out, "--num_experts", "1"], ["--num_experts 1", "at least 2"], ["num_experts_per_tok=2"]),
        (["upcycle", dense, out, "--moe_layer_frequency", "0"], ["moe_layer_frequency"], []),
        (["upcycle", "./no-such-model", out], ["SRC ./no-such-model: no such folder."], ["Hub"]),
        (["upcycle", str(t / "dense-typo"), out], ["no such folder."], ["Hub"]),
        (["upcycle", str(t / "dense" / "typo"), out], ["no such folder."], ["Hub"]),
        (["import", dense, out], ["gpt2"], ["Traceback"]),
        (["export", moe, out, "--to", "llama"], ["--to", "invalid choice: 'llama'"], []),
        (["merge", str(t / "cut"), out], ["model.safetensors is cut short", "again"], []),
        (["merge", str(t / "cut-checked"), out], ["model.safetensors", "again"], []),
        (["upcycle", str(t / "dense-cut"), out], ["model.safetensors is cut short", "again"], []),
        (["train", "--max_steps", "ten"], ["--max_steps", "invalid int value"], []),
        (["train", "--upcycle_from", dense, "--num_experts", "1"], ["--num_experts_per_tok 2 (the default)", "--num_experts 1"], []),
        (["train", "--model_name_or_path", str(t / "runs" / "typo")], ["--model_name_or_path", "no such folder."], ["Hub"]),
        (["demo", "--num_experts", "0"], ["--num_experts must be >= 1"], []),
        (["megatron", "to-megatron", moe, out, "--tp", "0"], ["--tp 0"], []),
    ]


def test_every_command_refuses_its_realistic_mistakes_in_one_line(folders, capsys, monkeypatch):
    import huggingface_hub

    def no_hub(*args, **kwargs):
        raise AssertionError("a local-looking path must not be looked up on the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    commands = set()
    for argv, words, absent in _mistakes(folders):
        line = _refusal(capsys, argv)
        assert all(w in line for w in words) and not any(w in line for w in absent), (argv, line)
        commands.add(argv[0])
    assert commands == {"upcycle", "merge", "import", "export", "train", "demo", "megatron"}
    assert not (folders / "out").exists()


def test_a_relative_path_under_an_existing_folder_is_local(folders, capsys, monkeypatch):
    monkeypatch.chdir(folders)  # `dense/typo`: the folder dense/ is here, so no Hub id is meant
    line = _refusal(capsys, ["upcycle", "dense/typo", "out"])
    assert line.endswith("SRC dense/typo: no such folder."), line


def test_a_cut_short_weight_file_is_named_when_loading(folders):
    from transformers import AutoModelForCausalLM

    from hf_ppmoe.utils.integrity import CheckpointError

    for name in ("cut", "cut-checked"):
        with pytest.raises(CheckpointError, match=r"model\.safetensors .*again"):
            AutoModelForCausalLM.from_pretrained(folders / name)


def test_upcycle_help_states_the_layer_frequency_default(capsys):
    with pytest.raises(SystemExit):
        main(["upcycle", "--help"])
    assert "default 2" in " ".join(capsys.readouterr().out.split())


def test_one_expert_and_beams_beyond_the_vocabulary_are_warned(folders):
    import torch

    from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
    from hf_ppmoe.conversion import upcycle

    with pytest.warns(UserWarning, match="num_experts=1"):
        upcycle(folders / "dense", num_experts=1, num_experts_per_tok=1)
    model = GPTMoEForCausalLM(GPTMoEConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_experts=2, moe_layer_frequency=1)).eval()
    with pytest.warns(UserWarning, match="num_beams=12 is more than the vocabulary"):
        model.generate(torch.tensor([[1, 2]]), num_beams=12, max_new_tokens=1, do_sample=False)


# ---- issue 46: the same mistakes, as a user runs them (a fresh process): flag words, before torch is imported ----

WORDS = """
import contextlib, io, json, sys, hf_ppmoe_cli
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = hf_ppmoe_cli.main(argv)
        except SystemExit as exit:
            code = exit.code
    results.append([code, err.getvalue().splitlines()])
print(json.dumps([results, "torch" in sys.modules]))
"""


def test_mistakes_are_refused_in_flag_words_before_torch_in_a_fresh_process(tmp_path):
    import json
    import re

    missing, out = str(tmp_path / "no-such-source"), str(tmp_path / "out")
    cases = [
        (["upcycle", missing, out, "--num_experts", "4", "--num_experts_per_tok", "8"],
         "hf-ppmoe upcycle: error: --num_experts_per_tok 8 is more than --num_experts 4"),
        (["upcycle", missing, out, "--router_type", "topp"],
         "hf-ppmoe upcycle: error: --router_type topp: no such gate; use one of topk, switch, gshard, prototype; did you "
         "mean --router_type topk?"),
        (["upcycle", missing, out, "--router_type", "switch", "--num_experts_per_tok", "2"],
         "hf-ppmoe upcycle: error: --router_type switch routes each token to 1 expert, not --num_experts_per_tok 2"),
        (["train", "--num_experts", "4", "--num_experts_per_tok", "8", "--output_dir", out],
         "hf-ppmoe train: error: --num_experts_per_tok 8 is more than --num_experts 4"),
        (["train", "--router_type", "topp", "--output_dir", out], "hf-ppmoe train: error: --router_type topp: no such gate"),
        (["train", "--router_type", "prototype", "--num_experts", "6", "--num_experts_per_tok", "4", "--output_dir", out],
         "hf-ppmoe train: error: --router_type prototype splits --num_experts 6 into --num_experts_per_tok 4 prototypes"),
        (["train", "--max_steps", "0", "--output_dir", out], "hf-ppmoe train: error: --max_steps must be >= 1, got 0."),
        (["upcycel", missing, out], "hf-ppmoe: error: unknown command 'upcycel'; did you mean 'hf-ppmoe upcycle'?"),
    ]
    result = subprocess.run([sys.executable, "-c", WORDS, json.dumps([argv for argv, _ in cases])], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr[-3000:]
    results, torch_imported = json.loads(result.stdout.splitlines()[-1])
    for (argv, expected), (code, lines) in zip(cases, results):
        assert code == 2 and len(lines) == 2 and lines[0].startswith("usage: hf-ppmoe"), (argv, lines)
        assert lines[1].startswith(expected), (argv, lines[1])
        assert not re.search(r"\b[a-z_]+=", lines[1]), lines[1]  # no Python name=value where a flag is meant
    assert not torch_imported
    assert not (tmp_path / "out").exists()
