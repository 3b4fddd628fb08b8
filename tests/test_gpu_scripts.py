"""The GPU kit's scripts on CPU: `scripts/gpu_check.sh` answers --help, and its dry run (`--device cpu`) writes one
complete report (setup, versions, tests/gpu, every benchmark section, or what did not run and why);
`scripts/build_gpu_wheels.sh`'s self-check names a requirement no wheel and no stock-image package meets."""

import os
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "scripts" / "gpu_check.sh"
pytestmark = pytest.mark.skipif(os.name != "posix", reason="bash scripts")


def gpu_check(*args, timeout=120):
    """`timeout` (seconds, None: none) only guards against a hang; what a test checks never depends on it."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    return subprocess.run(["bash", str(CHECK), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_help_names_every_option():
    out = gpu_check("--help").stdout
    for option in ("--device", "--wheels", "--out", "--budget", "--test-timeout", "--quick", "--sections"):
        assert option in out, option
    assert gpu_check("--bogus").returncode == 2


def test_cpu_dry_run_writes_a_complete_report(tmp_path):
    """Three sections at tiny shapes, eager (the layer section is left out and must be reported as such). `--budget 0`
    runs every step without a time limit, so a busy machine makes the run slower, never incomplete."""
    report = tmp_path / "report.md"
    run = gpu_check("--device", "cpu", "--no-compile", "--sections", "training decode quant", "--wheels",
                    str(tmp_path / "none"), "--out", str(report), "--budget", "0", timeout=None)
    assert run.returncode == 0, run.stderr
    text = report.read_text()
    assert "torch 2." in text and "transformers 5." in text and "import hf_ppmoe: ok" in text
    assert "tests/gpu/test_cuda.py (rc 0): " in text and "skipped" in text  # no CUDA: every GPU test skips
    assert "### layer: NOT RUN, not asked for" in text
    assert "### Training step" in text and "| Qwen3-MoE E=8 k=2 |" in text
    assert "### Greedy decoding" in text and "| 4 | Qwen3-MoE grouped_mm |" in text
    assert "### Quantized experts (benchmarks/quantization.py" in text and "| gpt_moe | 4-bit |" in text
    assert "## Not run" not in text and "NOT RUN, no time left" not in text and "(no budget)" in text


def test_report_names_what_did_not_run_when_the_budget_is_spent(tmp_path):
    report = tmp_path / "report.md"
    run = gpu_check("--device", "cpu", "--wheels", str(tmp_path / "none"), "--out", str(report), "--budget", "2")
    assert run.returncode == 0, run.stderr
    text = report.read_text()
    assert "tests/gpu/test_cuda.py: NOT RUN, no time left" in text
    for section in ("layer", "training", "decode", "quant"):
        assert f"### {section}: NOT RUN, no time left in the budget" in text
    assert "Finished after" in text


def fake_wheel(folder: Path, name: str, version: str, *requires: str):
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                      *[f"Requires-Dist: {r}" for r in requires]])
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta + "\n")


def test_wheel_self_check_names_what_is_missing(tmp_path):
    """httpcore2 needs truststore (not in a stock image): the check fails naming it; markers for other platforms or
    extras are ignored; a too-old wheel is named; with truststore added the check passes."""
    fake_wheel(tmp_path, "httpcore2", "2.16.2", "truststore>=0.10", "h11>=0.16", "numpy; python_version>='3.9'",
               "pywin32; sys_platform == 'win32'", "socksio; extra == 'socks'")
    fake_wheel(tmp_path, "pytest", "9.2.0", "pluggy>=1.5")
    fake_wheel(tmp_path, "pluggy", "1.0.0")

    def check():
        return subprocess.run(["bash", str(ROOT / "scripts" / "build_gpu_wheels.sh"), str(tmp_path)], cwd=ROOT,
                              env={**os.environ, "CHECK_ONLY": "1"}, capture_output=True, text=True, timeout=60)

    run = check()
    assert run.returncode != 0
    assert "httpcore2-2.16.2-py3-none-any.whl needs truststore>=0.10" in run.stderr
    assert "needs pluggy>=1.5, DIR has pluggy 1.0.0" in run.stderr
    assert "pywin32" not in run.stderr and "socksio" not in run.stderr and "h11" not in run.stderr
    fake_wheel(tmp_path, "truststore", "0.10.5")
    (tmp_path / "pluggy-1.0.0-py3-none-any.whl").unlink()
    fake_wheel(tmp_path, "pluggy", "1.7.0")
    run = check()
    assert run.returncode == 0, run.stderr
    assert "self-check passed" in run.stdout
