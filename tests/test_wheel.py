"""The install that works today: the wheel built from this tree holds everything the package reads at run time.

hf-ppmoe is not on PyPI yet. The wheel is built from a copy of the tree (so no build/ or egg-info lands in the
checkout), installed into an empty folder with `pip install --no-deps --target`, and imported from there in a process
whose working directory and path hold no source tree. The package reads its own module sources at run time: the
remote-code files and `custom_generate/generate.py` that `save_pretrained` writes are copies of them.
"""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import torch
    import hf_ppmoe
    target = Path(sys.argv[1]).resolve()
    assert Path(hf_ppmoe.__file__).resolve().is_relative_to(target), hf_ppmoe.__file__
    from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
    from transformers import AutoModelForCausalLM
    config = GPTMoEConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_experts=2, num_experts_per_tok=1)
    model = GPTMoEForCausalLM(config).eval()
    model.save_pretrained("saved")
    saved = Path("saved")
    assert (saved / "custom_generate" / "generate.py").is_file(), sorted(p.name for p in saved.iterdir())
    assert (saved / "modeling_gpt_moe.py").is_file(), sorted(p.name for p in saved.iterdir())
    ids = torch.tensor([[1, 2, 3]])
    again = AutoModelForCausalLM.from_pretrained("saved", trust_remote_code=True)
    assert torch.equal(model(ids).logits, again(ids).logits)
    beams = again.generate(ids, max_new_tokens=2, num_beams=2, custom_generate="saved", trust_remote_code=True)
    assert beams.shape == (1, 5), beams.shape
    from importlib.metadata import entry_points
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "hf-ppmoe"]
    script.load()
    print("ok")
    """
)


def _version(name: str) -> tuple[int, ...]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(part) for part in version(name).split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return (0,)


def test_wheel_installs_and_runs_from_an_empty_target(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("hf_ppmoe", "hf_ppmoe_cli"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # offline with this environment's setuptools (torch requires a recent one); one that cannot build a wheel by
    # itself (< 70.1 needs the `wheel` package) is replaced by pip's isolated build, which fetches pyproject's
    offline = _version("setuptools") >= (70, 1)
    build = ["--no-build-isolation", "--no-index"] if offline else []
    done = subprocess.run([*pip, "wheel", "--no-deps", *build, ".", "-w", str(tmp_path / "dist")],
                          cwd=source, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    (wheel,) = (tmp_path / "dist").glob("hf_ppmoe-*.whl")
    target = tmp_path / "target"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    assert not list(target.glob("*.egg-link")) and (target / "hf_ppmoe" / "__init__.py").is_file()

    run = tmp_path / "run"
    run.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), HF_HUB_OFFLINE="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    done = subprocess.run([sys.executable, "-P", "-c", CHECK, str(target)], cwd=run, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]


def test_model_cards_give_an_install_that_works():
    from hf_ppmoe import GPTMoEConfig
    from hf_ppmoe.utils.model_card import _loading

    text = _loading(GPTMoEConfig(), "me/my-moe")
    assert "pip install hf-ppmoe" not in text
    assert "pip install -e ." in text and 'trust_remote_code=True' in text
