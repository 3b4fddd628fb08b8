"""`Accelerator(megatron_lm_plugin=...)` training GPT-MoE end to end. Accelerate's Megatron backend imports
megatron.training / megatron.legacy (only a Megatron-LM source checkout has them) and asserts CUDA when it
initializes, so this test is skipped unless both are present; what it can run on CPU is tested in
test_megatron_model.py (model, train step, schedules) and test_megatron_conversion.py (checkpoints)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_gpt_config

from hf_ppmoe import GPTMoEForCausalLM
from hf_ppmoe.megatron.weights import convert_hf_to_megatron, convert_megatron_to_hf


def _missing() -> list[str]:
    missing = []
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        missing.append("2 CUDA GPUs (Megatron-LM's initialization asserts CUDA; the test runs TP = EP = 2)")
    try:
        found = importlib.util.find_spec("megatron.training") is not None
    except ImportError:
        found = False
    if not found:
        missing.append(
            "Megatron-LM's source tree on PYTHONPATH (git clone https://github.com/NVIDIA/Megatron-LM; its "
            "megatron.training and megatron.legacy are in no PyPI wheel, and its megatron.core should be 0.16.1)"
        )
    return missing


@pytest.mark.skipif(bool(_missing()), reason="needs " + " and ".join(_missing()))
def test_accelerate_megatron_trains_converted_gpt_moe(tmp_path):
    config = tiny_gpt_config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    torch.manual_seed(0)
    model = GPTMoEForCausalLM(config)
    model.save_pretrained(tmp_path / "hf")
    convert_hf_to_megatron(tmp_path / "hf", tmp_path / "megatron", tp=2)
    batches = [torch.randint(3, 256, (4, 16), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    torch.save(batches, tmp_path / "batches.pt")
    with torch.no_grad():
        reference = model(batches[0], labels=batches[0]).loss.item()

    script = Path(__file__).with_name("megatron_accelerate_train.py")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"},
    )
    assert run.returncode == 0, run.stderr[-8000:]
    losses = json.loads((tmp_path / "losses.json").read_text())
    # the first step runs the converted weights: Megatron's loss (LM + aux + z, as reported) = Transformers'
    assert losses[0] == pytest.approx(reference, rel=1e-4)
    trained = convert_megatron_to_hf(tmp_path / "trained", tmp_path / "hf-trained", config, weights_only=False)
    with torch.no_grad():
        assert trained.eval()(batches[0], labels=batches[0]).loss.item() < reference
