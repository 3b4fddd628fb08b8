"""`hf_ppmoe.training`: data parallel == one process, kill + resume == uninterrupted, logs/plots, argument errors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from hf_ppmoe import GPTMoEConfig
from hf_ppmoe.training import TrainArguments, main
from hf_ppmoe.training.data import builtin_corpus
from hf_ppmoe.training.tracking import read_jsonl

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text file (a slice of the built-in corpus) and tiny GPT-MoE configs with 1 and 2 router groups."""
    root = tmp_path_factory.mktemp("data")
    (root / "train.txt").write_text("\n\n".join(builtin_corpus()[:12]))
    for groups in (1, 2):
        GPTMoEConfig(
            vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, router_type="gshard",
            capacity_factor=1.5, router_random_routing=False, router_num_groups=groups,
        ).to_json_file(root / f"config_g{groups}.json")
    return root


def flags(corpus, out, steps=4, **extra):
    values = dict(
        train_file=str(corpus / "train.txt"), config_name=str(corpus / "config_g1.json"), output_dir=str(out),
        max_steps=steps, per_device_train_batch_size=8, block_size=32, eval_steps=2, eval_batches=2,
        learning_rate=3e-3, warmup_steps=1, plots=False,
        # Adam turns float noise on near-zero gradients into full +-lr steps; a larger epsilon keeps runs that
        # compute the same gradients in different orders (1 vs 2 processes) on the same trajectory
        adam_epsilon=1e-4,
    )
    values.update(extra)
    return [f"--{k}={v}" for k, v in values.items()]


def run_cli(argv, launcher=(), timeout=600):
    cmd = [*launcher, "-m", "hf_ppmoe.training", *argv] if launcher else [sys.executable, "-m", "hf_ppmoe.training", *argv]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)


def train_losses(out):
    return {r["step"]: r["train/lm_loss"] for r in read_jsonl(Path(out) / "logs" / "metrics.jsonl") if "train/lm_loss" in r}


def test_two_process_data_parallel_equals_one_process(corpus, tmp_path):
    """2 processes x 4 sequences == 1 process x 8 sequences. Each data-parallel replica computes its router losses
    on its own tokens, exactly as GShard's router groups do, so the 1-process reference uses router_num_groups=2."""
    single = tmp_path / "single"
    main(_args(corpus, single, config_name=str(corpus / "config_g2.json"), max_steps=3))
    # `accelerate launch --cpu` starts one process (several CPU processes need MPI); torchrun starts two, and
    # Accelerate picks them up as a multi-CPU (gloo) data-parallel run
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    result = run_cli(flags(corpus, tmp_path / "dp", steps=3, per_device_train_batch_size=4), launcher=launcher)
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = train_losses(single), train_losses(tmp_path / "dp")
    assert a.keys() == b.keys() == {1, 2, 3}
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-5, abs=1e-5), (step, a, b)
    for key in ("train/aux_loss", "train/grad_norm"):
        values_a = [r[key] for r in read_jsonl(single / "logs" / "metrics.jsonl") if key in r]
        values_b = [r[key] for r in read_jsonl(tmp_path / "dp" / "logs" / "metrics.jsonl") if key in r]
        assert values_a == pytest.approx(values_b, rel=1e-4), key


def _args(corpus, out, **extra):
    """The same flags, parsed as the CLI parses them, for an in-process run."""
    return HfArgumentParser(TrainArguments).parse_args_into_dataclasses(flags(corpus, out, **extra))[0]


def test_kill_and_resume_equals_uninterrupted(corpus, tmp_path):
    reference = tmp_path / "reference"
    main(_args(corpus, reference, max_steps=6, checkpointing_steps=2))
    expected = train_losses(reference)

    run = tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "hf_ppmoe.training", *flags(corpus, run, steps=6, checkpointing_steps=2)],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step_4" / "trainer_state.json").exists():
        assert process.poll() is None and time.time() < deadline, "the run ended before its step-4 checkpoint"
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (run / "model.safetensors").exists(), "the run was killed before it finished"

    main(_args(corpus, run, max_steps=6, checkpointing_steps=2, resume="latest"))
    resumed = train_losses(run)
    assert resumed.keys() == expected.keys() == set(range(1, 7))
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-6), step
    assert not list((run / "checkpoints").glob("*.saving"))


def test_outputs_logs_and_plots(corpus, tmp_path):
    summary = main(_args(corpus, tmp_path, max_steps=2, plots=True))
    assert summary["step"] == 2 and summary["eval/loss"] > 0
    records = read_jsonl(tmp_path / "logs" / "metrics.jsonl")
    train = [r for r in records if "train/lm_loss" in r]
    assert {"train/aux_loss", "train/z_loss", "train/tokens_per_second", "expert_load_cv/layers.1",
            "dropped_fraction/layers.1"} <= set(train[-1])
    assert (tmp_path / "plots" / "loss.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "expert_load.png").stat().st_size > 1000
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert model.config.num_experts == 4 and len(tokenizer) <= model.config.vocab_size


def test_jsonl_and_datasets_sources(tmp_path):
    from hf_ppmoe.training.train import load_texts

    rows = [{"text": t} for t in builtin_corpus()[:3]]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts, _ = load_texts(TrainArguments(train_file=[str(tmp_path / "data.jsonl")]))
    assert texts == [r["text"] for r in rows]
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    texts, _ = load_texts(TrainArguments(dataset_name=str(tmp_path / "ds")))
    assert texts == [r["text"] for r in rows]
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="has no 'text' field"):
        load_texts(TrainArguments(train_file=[str(tmp_path / "bad.jsonl")]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(train_file=["/no/such/file.txt"]), "Data file /no/such/file.txt does not exist"),
        (dict(model_name_or_path="x", upcycle_from="y"), "Give only one of"),
        (dict(block_size=0), "--block_size must be >= 1"),
        (dict(mixed_precision="fp8"), "--mixed_precision 'fp8'"),
        (dict(resume="/no/checkpoint"), "no such checkpoint folder"),
        (dict(config_name="/no/config.json"), "does not exist"),
    ],
)
def test_argument_errors_before_any_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainArguments(**kwargs).validate()


def test_errors_that_need_the_model_config(monkeypatch):
    config = GPTMoEConfig(num_experts=6, position_embedding_type="learned", max_position_embeddings=64)
    with pytest.raises(ValueError, match="--tp_size 4 does not divide num_experts=6"):
        TrainArguments(tp_size=4, block_size=32).check_model(config)
    with pytest.raises(ValueError, match="--block_size 128 exceeds the model's max_position_embeddings=64"):
        TrainArguments(block_size=128).check_model(config)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="--push_to_hub was given but HF_HUB_OFFLINE is set"):
        TrainArguments(push_to_hub=True).validate()


def test_cli_reports_bad_arguments_in_one_line(tmp_path):
    result = run_cli(["--train_file", str(tmp_path / "missing.txt"), "--output_dir", str(tmp_path)])
    assert result.returncode == 2
    assert "error: Data file" in result.stderr and "Traceback" not in result.stderr
