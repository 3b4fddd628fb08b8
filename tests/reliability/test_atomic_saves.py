"""Saves, conversions and training checkpoints killed by real signals and run out of space (io_kill_scenarios.py,
run once in a subprocess): afterwards the folder loads with its complete old or complete new contents, the next write
leaves no temporary folder behind, and a full disk is a clear error that changes nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("io_kill_scenarios.py")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("kills")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, env=env, timeout=600)
    found = {}
    for line in result.stdout.splitlines():
        if line.startswith('{"scenario"'):
            report = json.loads(line)
            found[report.pop("scenario")] = report
    assert result.returncode == 0 and len(found) == 3, result.stderr[-3000:]
    return found


def _no_error(report):
    assert "error" not in report, report["error"]


def _out_of_space(message, target):
    assert message.startswith("OutOfSpaceError:") and "Not enough space to write" in message, message
    assert target in message and "Nothing was changed" in message, message


def test_save_pretrained_over_a_sharded_checkpoint(reports):
    report = reports["save_pretrained"]
    _no_error(report)
    _out_of_space(report["full_disk_error"], "model")
    assert report["after_full_disk"] == "config old, weights old" and report["leftovers_after_full_disk"] == []
    # SIGKILL right after the first rename or deletion that changed the folder: the new save, whole
    assert report["signal"] == "SIGKILL"
    assert report["after_kill"] == "config new, weights new" and report["tokenizer_kept"]
    assert report["leftovers_after_kill"]  # the old folder, not yet deleted: the next save removes it
    assert report["after_next_save"] == "config new, weights new" and report["leftovers_after_next_save"] == []


def test_conversion_with_overwrite(reports):
    report = reports["conversion"]
    _no_error(report)
    _out_of_space(report["full_disk_error"], "moe")
    assert report["after_full_disk"] == "4 experts, equal logits" and report["leftovers_after_full_disk"] == []
    assert report["cli_exit_code"] == 1 and "hf-ppmoe upcycle: error: [Errno 27] Not enough space" in report["cli_full_disk"][1]
    # SIGTERM between the two renames (old OUT aside, new not yet in place), handled as SIGINT: the old OUT is put
    # back, the temporary folder deleted, and the process dies by SIGTERM ...
    assert report["signal"] == "SIGTERM" and report["out_exists_after_kill"] and report["leftovers_after_kill"] == 0
    # ... so the next conversion finds the old OUT (and refuses to overwrite it)
    assert report["without_overwrite"][0] == 2 and "already exists" in report["without_overwrite"][1]
    assert report["after_kill"] == "4 experts, equal logits"
    assert report["after_next_conversion"] == "2 experts, equal logits" and report["leftovers_after_next_conversion"] == []


def test_training_checkpoints(reports):
    report = reports["checkpoint"]
    _no_error(report)
    _out_of_space(report["full_disk_error"], "step_4")
    assert report["after_full_disk"] == ["step_2"]
    assert report["signal"] == "SIGKILL"  # after Accelerate wrote its state, before the checkpoint was complete
    assert [name for name in report["after_kill"] if not name.startswith(".")] == ["step_2"]
    assert report["resumes_from"] == "step_2"
    assert report["after_next_save"] == ["step_2", "step_6"]  # the killed save's temporary folder is gone
