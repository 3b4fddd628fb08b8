import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/NAME.py as a module (registered in sys.modules: its dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def tiny_gpt_config(**overrides):
    from hf_ppmoe import GPTMoEConfig

    kwargs = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_layer_frequency=1,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    kwargs.update(overrides)
    return GPTMoEConfig(**kwargs)


GPT2_STYLE = dict(
    position_embedding_type="learned",
    norm_type="layernorm",
    layer_norm_eps=1e-5,
    gated_mlp=False,
    hidden_act="gelu_new",
    attention_bias=True,
    mlp_bias=True,
    tie_word_embeddings=True,
    num_key_value_heads=4,
)


def tiny_seq2seq_config(**overrides):
    from hf_ppmoe import Seq2SeqMoEConfig

    kwargs = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_decoder_layers=2,
        num_attention_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_layer_frequency=1,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    kwargs.update(overrides)
    return Seq2SeqMoEConfig(**kwargs)


def trainer_rows(family, labels_padded=True, n=4, length=8, seed=0):
    """`n` training examples for Transformers' Trainer (dicts of input_ids and labels) for the "gpt" or "seq2seq"
    family; with `labels_padded`, rows 0 and 3 have fewer label tokens (-100 after a few)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (n, length), generator=g)
    labels = ids.clone()
    if labels_padded:
        labels[0, 5:] = -100
        labels[3, 2:] = -100
    inputs = ids if family == "gpt" else torch.randint(3, 97, (n, length + 2), generator=g)
    return [{"input_ids": i, "labels": l} for i, l in zip(inputs, labels)]


def stack_rows(examples):
    return {key: torch.stack([e[key] for e in examples]) for key in examples[0]}


def trainer_args(out, **overrides):
    """Trainer arguments for a quick CPU run: one step, logged, in order, nothing saved or reported (Seq2Seq's, which
    Trainer takes too)."""
    from transformers import Seq2SeqTrainingArguments

    values = dict(
        output_dir=str(out), max_steps=1, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, train_sampling_strategy="sequential", dataloader_num_workers=0,
    )
    values.update(overrides)
    return Seq2SeqTrainingArguments(**values)


# Runs the training CLI and SIGKILLs the process right after it has logged step 5, so the kill lands at the same
# point every time: after the step-4 checkpoint, with a logged step that the resumed run must drop and redo.
KILLED_AFTER_STEP_5 = """
import os, signal, sys
from hf_ppmoe.training.__main__ import cli
from hf_ppmoe.training.tracking import JSONLinesTracker

log = JSONLinesTracker.log

def log_then_die(self, values, step=None, **kwargs):
    log(self, values, step, **kwargs)
    if step == 5 and "train/lm_loss" in values:
        os.kill(os.getpid(), signal.SIGKILL)

JSONLinesTracker.log = log_then_die
sys.exit(cli(sys.argv[1:]))
"""


def torchrun_script(script: str, body: str, *args: str, nprocs: int = 2) -> None:
    """Run `script body args...` on `nprocs` torchrun processes; a failure shows the ranks' tracebacks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}"]
    done = subprocess.run([*command, script, body, *args], env=env, capture_output=True, text=True, timeout=900)
    ranks = "\n".join(line for line in done.stderr.splitlines() if line.startswith("[rank"))  # their tracebacks
    assert done.returncode == 0, f"{body} failed:\n{done.stdout[-2000:]}\n{ranks[-12000:] or done.stderr[-8000:]}"
