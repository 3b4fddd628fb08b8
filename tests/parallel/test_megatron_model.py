"""The megatron-core GPTModel built from our config reproduces GPTMoEForCausalLM: logits, every gradient, and the
losses GPTMoETrainStep reports, with experts on the TP group (TP = EP = 2), with PP = 2, and with TP = 1.

All checks run in one torchrun launch of megatron_checks.py (2 CPU processes, gloo, about a minute: importing
megatron-core costs ~20 s per process), with the CPU patches of megatron_cpu.py confined to those processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_cpu import MEGATRON_CORE_VERSION


def _missing() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("megatron-core")
    except PackageNotFoundError:
        return 'needs megatron-core (pip install -e ".[megatron]")'
    if found != MEGATRON_CORE_VERSION:
        return (
            f"the CPU patches in megatron_cpu.py are written for megatron-core {MEGATRON_CORE_VERSION}, found {found}"
        )
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")

SCRIPT = Path(__file__).with_name("megatron_checks.py")
NAMES = ("llama", "gpt2", "qwen")  # see megatron_checks.CONFIGS
CHECKS = (
    [
        f"{layout}/{name}/{what}"
        for layout in ("tp2", "tp1")
        for name in NAMES
        for what in ("logits", "logits_from_megatron")
    ]
    + ["tp2/llama/checkpoint_logits", "tp2/llama/padded_lm_loss", "pp2/llama/logits", "pp2/gpt2/logits"]
    + [
        f"{layout}/{name}/{what}"
        for layout, name in (("tp2", "llama"), ("tp2", "gpt2"), ("tp1", "gpt2"))
        for what in ("grads", "lm_loss", "aux_loss", "z_loss", "total_loss")
    ]
    + [f"pp2/{name}/{what}" for name in ("llama", "gpt2") for what in ("grads", "lm_loss", "reports_lm_loss_only")]
)
TOLERANCE = 1e-5  # float32; measured differences are below 2e-7


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    work = tmp_path_factory.mktemp("megatron")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(SCRIPT),
        str(work / "results.json"),
        str(work),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        pytest.fail(f"megatron_checks.py failed ({run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-8000:]}")
    return json.loads((work / "results.json").read_text())


@pytest.mark.parametrize("check", CHECKS)
def test_megatron_matches_hf(measured, check):
    assert check in measured, f"{check} was not run (ran: {sorted(measured)})"
    value = measured[check]
    assert not isinstance(value, str), f"{check} raised:\n{value}"
    assert value <= TOLERANCE, f"{check}: largest difference to GPTMoEForCausalLM is {value}"


def test_every_check_is_asserted(measured):
    assert set(measured) == set(CHECKS)
