"""Resuming training continues the run that wrote the checkpoint, or refuses with the reason: changed settings are
listed (and accepted only when named), `--resume latest` never takes an earlier run's checkpoint, a run that fails to
start leaves the earlier logs alone, truncated checkpoint files are named with the intact checkpoint before them, a
line torn by a real SIGKILL in metrics.jsonl is dropped on resume, a checkpoint's --tp_size and the processes' seeds
must agree (one 2-process launch), and bad training files are named with their line."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from hf_ppmoe import GPTMoEConfig
from hf_ppmoe.training import TrainArguments, main
from hf_ppmoe.training.checkpoints import find_checkpoint
from hf_ppmoe.training.data import builtin_corpus, read_text_files
from hf_ppmoe.training.tracking import read_jsonl

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "train.txt").write_text("\n\n".join(builtin_corpus()[:6]))
    for gate in ("gshard", "topk"):
        GPTMoEConfig(
            vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, router_type=gate,
            router_random_routing=False,
        ).to_json_file(root / f"{gate}.json")
    return root


def flags(corpus, out, **extra):
    values = dict(
        train_file=corpus / "train.txt", config_name=corpus / "gshard.json", output_dir=out, max_steps=4,
        checkpointing_steps=2, per_device_train_batch_size=4, block_size=32, eval_steps=100, eval_batches=1,
        learning_rate=3e-3, warmup_steps=1, plots=False,
    )
    values.update(extra)
    return [f"--{k}={v}" for k, v in values.items() if not isinstance(v, list)] + [
        a for k, v in values.items() if isinstance(v, list) for a in (f"--{k}", *v)
    ]


def args(corpus, out, **extra) -> TrainArguments:
    return HfArgumentParser(TrainArguments).parse_args_into_dataclasses(flags(corpus, out, **extra))[0]


def losses(out) -> dict[int, float]:
    return {r["step"]: r["train/lm_loss"] for r in read_jsonl(Path(out) / "logs" / "metrics.jsonl") if "train/lm_loss" in r}


@pytest.fixture(scope="module")
def run_a(corpus, tmp_path_factory):
    """4 steps, checkpoints at 2 and 4; tests resume from copies of it."""
    out = tmp_path_factory.mktemp("a") / "run"
    main(args(corpus, out))
    return out


def copy_of(run, tmp_path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def test_training_resume_with_changed_settings_is_refused_listing_them(corpus, run_a, tmp_path):
    out = copy_of(run_a, tmp_path)
    changed = dict(learning_rate=1e-3, seed=1, per_device_train_batch_size=2, config_name=corpus / "topk.json",
                   resume=out / "checkpoints" / "step_2")
    with pytest.raises(ValueError, match="settings differ from the checkpoint's") as error:
        main(args(corpus, out, **changed))
    message = str(error.value)
    for expected in ("learning_rate: 0.003 -> 0.001", "seed: 0 -> 1", "per_device_train_batch_size: 4 -> 2",
                     "config.router_type: 'gshard' -> 'topk'",
                     "--allow_resume_changes learning_rate per_device_train_batch_size seed config.router_type"):
        assert expected in message, message
    assert losses(out) == losses(run_a)  # nothing was touched

    allowed = ["learning_rate", "seed", "per_device_train_batch_size", "config.router_type"]
    main(args(corpus, out, **changed, allow_resume_changes=allowed))
    records = read_jsonl(out / "logs" / "metrics.jsonl")
    logged = [r for r in records if "resumed_with_changes" in r]
    assert len(logged) == 1 and logged[0]["step"] == 2 and sorted(logged[0]["resumed_with_changes"]) == sorted(allowed)
    assert sorted(losses(out)) == [1, 2, 3, 4]
    state = json.loads((out / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert state["changes"][0]["step"] == 2 and state["changes"][0]["changed"]["seed"] == [0, 1]


def test_training_resume_latest_takes_only_the_last_runs_checkpoints(corpus, run_a, tmp_path):
    out = copy_of(run_a, tmp_path)
    metrics, run_config = (out / "logs" / "metrics.jsonl").read_bytes(), (out / "logs" / "run_config.json").read_bytes()
    # a start that fails (after Accelerate and the trackers were set up) leaves the earlier run's logs as they were
    with pytest.raises(ValueError, match="--tp_size 2 needs a multiple of 2 processes"):
        main(args(corpus, out, tp_size=2))
    assert (out / "logs" / "metrics.jsonl").read_bytes() == metrics
    assert (out / "logs" / "run_config.json").read_bytes() == run_config

    # run B in the same folder writes step_3; run A's step_4 stays there, and is not B's latest
    main(args(corpus, out, seed=1, checkpointing_steps=3))
    assert {p.name for p in (out / "checkpoints").iterdir()} == {"step_2", "step_3", "step_4"}
    assert find_checkpoint(args(corpus, out, seed=1, checkpointing_steps=3, resume="latest")) == out / "checkpoints" / "step_3"

    # run C trains without checkpoints: --resume latest has nothing of C to take, and says where the others came from
    main(args(corpus, out, max_steps=1, checkpointing_steps=0))
    with pytest.raises(ValueError, match=r"wrote no checkpoint; step_2, step_3, step_4 .* belong to an earlier run"):
        find_checkpoint(args(corpus, out, resume="latest"))


def test_training_truncated_checkpoint_files_are_named_with_the_intact_earlier_checkpoint(corpus, run_a, tmp_path):
    out = copy_of(run_a, tmp_path)
    step_2, step_4 = out / "checkpoints" / "step_2", out / "checkpoints" / "step_4"
    for name in ("random_states_0.pkl", "model.safetensors"):
        intact = (step_4 / name).read_bytes()
        (step_4 / name).write_bytes(intact[: len(intact) // 2])
        with pytest.raises(ValueError) as error:
            main(args(corpus, out, resume="latest"))
        message = str(error.value)
        assert f"{step_4 / name} has {len(intact) // 2} bytes, {len(intact)} were written" in message, message
        assert f"resume from it with --resume {step_2}" in message, message
        (step_4 / name).write_bytes(intact)


TORN_AT_STEP_3 = """
import os, signal, sys
from hf_ppmoe.training.__main__ import cli
from hf_ppmoe.training.tracking import JSONLinesTracker

log = JSONLinesTracker.log

def torn_log(self, values, step=None, **kwargs):
    if step == 3 and "train/lm_loss" in values:  # the kill lands mid-write: half a line, no newline
        with self.path.open("a") as f:
            f.write('{"step": 3, "train/lm_loss": 4.')
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    log(self, values, step, **kwargs)

JSONLinesTracker.log = torn_log
sys.exit(cli(sys.argv[1:]))
"""


def test_training_line_torn_by_a_kill_is_dropped_on_resume(corpus, run_a, tmp_path):
    out = tmp_path / "killed"
    result = subprocess.run([sys.executable, "-c", TORN_AT_STEP_3, *flags(corpus, out)], env=ENV, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == -9, result.stderr[-3000:]  # killed by the signal, not finished or failed
    assert not (out / "logs" / "metrics.jsonl").read_text().endswith("\n")
    main(args(corpus, out, resume="latest"))  # from step 2
    resumed, expected = losses(out), losses(run_a)
    assert resumed.keys() == expected.keys() == {1, 2, 3, 4}
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-6), step


def test_training_checkpoint_layout_and_process_agreement_in_two_processes(corpus, tmp_path):
    """One launch of 2 processes: a --tp_size 2 checkpoint resumed without it and a data-parallel one resumed with
    it are refused naming the layout; processes started with different seeds, or building different weights from
    the same arguments, are refused before training."""
    tp, dp = tmp_path / "tp", tmp_path / "dp"
    one_step = dict(max_steps=1, checkpointing_steps=1)
    runs = [
        {"argv": flags(corpus, tp, tp_size=2, **one_step)},
        {"argv": flags(corpus, dp, **one_step)},
        {"argv": flags(corpus, tmp_path / "r1", max_steps=2, resume=tp / "checkpoints" / "step_1"),
         "error": "this checkpoint was written with --tp_size 2 (this run: --tp_size 1)"},
        {"argv": flags(corpus, tmp_path / "r2", max_steps=2, tp_size=2, resume=dp / "checkpoints" / "step_1"),
         "error": "this checkpoint was written with --tp_size 1 (this run: --tp_size 2)"},
        {"argv": flags(corpus, tmp_path / "s", tp_size=2, seed="{rank}", **one_step),
         "error": "started with different arguments (seed=0 on rank 0, 1 on rank 1)"},
        {"argv": flags(corpus, tmp_path / "w", tp_size=2, **one_step), "seed_offset_by_rank": True,
         "error": "Rank 1 built other initial weights than rank 0"},
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(Path(__file__).with_name("training_runs.py")), json.dumps(runs)]
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert not (tmp_path / "s" / "logs").exists() and not (tmp_path / "w" / "logs").exists()  # refused before training


def test_training_files_that_are_not_text_or_json_lines_are_named_with_their_line(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"text": "one"}\n{"text": "two"\n')
    with pytest.raises(ValueError, match=r"data.jsonl:2 is not a JSON line"):
        read_text_files([str(tmp_path / "data.jsonl")])
    (tmp_path / "list.jsonl").write_text('["text"]\n')
    with pytest.raises(ValueError, match=r"list.jsonl:1 is a JSON list, not an object with a 'text' field"):
        read_text_files([str(tmp_path / "list.jsonl")])
    (tmp_path / "binary.txt").write_bytes(b"text\nmore\n\x89PNG\x00\xff")
    with pytest.raises(ValueError, match=r"binary.txt:3 is not UTF-8 text"):
        read_text_files([str(tmp_path / "binary.txt")])
