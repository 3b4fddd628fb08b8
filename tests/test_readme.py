"""The front page and the docs: README.md stays short, every relative link resolves, every snippet runs as written.

The README's ```bash and ```python snippets run in order, each in its own process, in one temporary folder (later
snippets read what earlier ones wrote). A snippet preceded by `<!-- skip: REASON -->` is not run (the demo, the test
suite itself, what needs a GPU or the network).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 10_000  # bytes

FENCE = re.compile(r"^```(\w*)\s*$")
SKIP = re.compile(r"^<!--\s*skip:\s*(.+?)\s*-->\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`]*`")


def snippets(text: str) -> list[tuple[str, str, str | None]]:
    """(language, code, skip reason or None) of every fenced block, in order."""
    found, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        before = next((line for line in reversed(lines[:i]) if line.strip()), "")
        skip = SKIP.match(before)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        found.append((opening.group(1), "\n".join(lines[i + 1 : end]) + "\n", skip.group(1) if skip else None))
        i = end + 1
    return found


def prose(text: str, keep_code: bool = False) -> list[str]:
    """The lines outside fenced blocks, with inline code removed unless `keep_code`."""
    out, fence = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            out.append(line if keep_code else CODE_SPAN.sub("", line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in prose(page.read_text(encoding="utf-8"), keep_code=True):
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
    result = set()
    for base, n in seen.items():
        result.add(base)
        result.update(f"{base}-{i}" for i in range(1, n))
    return result


def test_readme_is_a_front_page():
    size = README.stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes; move reference text into docs/ (limit {README_LIMIT})"
    text = README.read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    test_command = [line for line in ci.splitlines() if "pytest" in line and not line.startswith("#")]
    assert len(test_command) == 1 and test_command[0].strip() in text, "the README's test command is not .ci/run's"
    assert "hf-ppmoe demo" in text


def test_no_install_from_an_unpublished_package():
    for page in PAGES:
        assert not re.search(r"pip install [\"']?hf-ppmoe\b", page.read_text(encoding="utf-8")), page


def test_slug_rule():
    assert slug("Fine-tuning with Transformers' Trainer") == "fine-tuning-with-transformers-trainer"
    assert slug("LoRA / PEFT") == "lora--peft"
    assert slug("`python -m hf_ppmoe.training`") == "python--m-hf_ppmoetraining"
    assert "python--m-hf_ppmoetraining" in anchors(ROOT / "docs" / "training.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    links = [m.group(1) for line in prose(page.read_text(encoding="utf-8")) for m in LINK.finditer(line)]
    broken = []
    for link in links:
        if re.match(r"^[a-z]+:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading with that anchor in {target.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_snippets_are_found():
    found = snippets(README.read_text(encoding="utf-8"))
    run = [(lang, code) for lang, code, skip in found if skip is None]
    assert all(lang in ("bash", "python") for lang, _, _ in found), [lang for lang, _, _ in found]
    assert sum(lang == "python" for lang, _ in run) >= 2 and sum(lang == "bash" for lang, _ in run) >= 2
    assert [skip is not None for _, _, skip in found[:2]] == [True, True]  # the two commands: demo, tests


def run_snippets(page: Path, tmp_path: Path) -> Path:
    """Run the page's ```bash and ```python snippets in order, each in its own process, in one empty folder
    (`tmp_path/work`, returned), the prepared-data cache kept in `tmp_path/cache`; skipped snippets are not run."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # hf-ppmoe of this Python
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["HF_DATASETS_CACHE"] = str(tmp_path / "cache")  # the prepared training data, out of the user's cache
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    work = tmp_path / "work"
    work.mkdir()
    for n, (lang, code, skip) in enumerate(snippets(page.read_text(encoding="utf-8"))):
        if skip is not None or lang not in ("bash", "python"):
            continue
        command = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
        done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{page.name} snippet {n} ({lang}) failed:\n{code}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return work


def test_readme_snippets_run_in_order(tmp_path):
    work = run_snippets(README, tmp_path)
    assert (work / "runs" / "moe" / "checkpoints").is_dir()  # the resume line had a checkpoint to find
