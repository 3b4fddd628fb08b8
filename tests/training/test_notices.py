"""Issue 46: other libraries' notices around our commands. Every checkpoint printed Accelerate's "Removed shared tensor
{'lm_head.weight'} while saving. This should be OK, but check ..."; with DeepSpeed installed, every command printed
"Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." Neither concerns a
run that does not use what it names; both stay where they do."""

import logging
import os
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator
from helpers import tiny_gpt_config

from hf_ppmoe import GPTMoEForCausalLM
from hf_ppmoe.training.checkpoints import Checkpointer, drop_tied_copies

NOTICE = "Removed shared tensor"


def test_checkpoints_leave_declared_tied_copies_out_without_a_notice(tmp_path, caplog):
    """The checkpoint holds what Accelerate would have kept (one copy of the tied embeddings), loading ties them
    again, and Accelerate has nothing to remove, so nothing to say. A tensor that shares memory without being declared
    tied is left for Accelerate to name."""
    torch.manual_seed(0)
    model = GPTMoEForCausalLM(tiny_gpt_config(tie_word_embeddings=True))
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    checkpointer = Checkpointer(accelerator, tmp_path, record={"run_id": "x"})
    with caplog.at_level(logging.WARNING):
        folder = checkpointer.save(1)
    assert NOTICE not in caplog.text
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    checkpointer.load(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())

    state = {"module.lm_head.weight": model.lm_head.weight, "module.model.embed_tokens.weight": model.model.embed_tokens.weight,
             "other": model.model.embed_tokens.weight}  # DDP's names, and an alias nobody declared
    drop_tied_copies([model], [state])
    assert sorted(state) == ["module.model.embed_tokens.weight", "other"]
    untied = GPTMoEForCausalLM(tiny_gpt_config(tie_word_embeddings=False)).state_dict()
    kept = dict(untied)
    drop_tied_copies([GPTMoEForCausalLM(tiny_gpt_config(tie_word_embeddings=False))], [kept])
    assert kept.keys() == untied.keys()


QUIET_IMPORT = "from hf_ppmoe.utils.quiet import quiet_notices; quiet_notices(); import deepspeed"


def test_deepspeeds_cpu_notice_is_dropped_for_our_commands_and_kept_under_deepspeed():
    pytest.importorskip("deepspeed", reason="the test extra: DeepSpeed is what prints it")
    if torch.cuda.is_available():
        pytest.skip("DeepSpeed prints the notice only where it finds no accelerator")
    outputs = {}
    for deepspeed in ("false", "true"):
        env = dict(os.environ, ACCELERATE_USE_DEEPSPEED=deepspeed, OMP_NUM_THREADS="1")
        result = subprocess.run([sys.executable, "-c", QUIET_IMPORT], capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stderr[-2000:]
        outputs[deepspeed] = result.stdout + result.stderr
    assert "Setting accelerator to CPU" not in outputs["false"]
    assert "Setting accelerator to CPU" in outputs["true"]  # Accelerate runs DeepSpeed: its choice matters, and shows
