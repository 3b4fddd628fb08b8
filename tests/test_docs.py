"""Issue 38: every fenced ```python and ```bash block of docs/*.md runs as written, in order, each in its own
process, in one empty folder per page (tests/test_readme.py's `run_snippets`, which runs the README's). A block that
needs a GPU, several processes or minutes says so on the line before it, `<!-- skip: REASON -->`, and is run by the
tests that cover what it shows (named in the reason); a block without a language is text (output, a listing) and
is not run."""

from pathlib import Path

import pytest
from test_readme import ROOT, run_snippets, snippets

DOCS = sorted((ROOT / "docs").glob("*.md"))
RUN = [page for page in DOCS if any(lang in ("bash", "python") and skip is None
                                    for lang, _, skip in snippets(page.read_text(encoding="utf-8")))]


def test_every_block_runs_or_says_why():
    for page in DOCS:
        for lang, code, skip in snippets(page.read_text(encoding="utf-8")):
            assert lang in ("bash", "python", ""), f"{page.name}: a ```{lang} block; use bash, python or none (text)"
            if skip is not None:
                assert lang in ("bash", "python") and len(skip) > 10, f"{page.name}: say why a block is not run"
    assert {p.name for p in RUN} >= {"conversion.md", "training.md", "generation.md", "models.md", "seq2seq.md"}


@pytest.mark.parametrize("page", RUN, ids=lambda p: p.name)
def test_page_blocks_run_in_order(page: Path, tmp_path):
    run_snippets(page, tmp_path)
