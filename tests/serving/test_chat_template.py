"""Chat templates on demand: `hf-ppmoe upcycle --chat_template` and `hf-ppmoe train --chat_template` write one that
`apply_chat_template` (and `hf-ppmoe serve`'s chat completions) use; an unknown one is refused before any work."""

import subprocess
import sys

import pytest
from converters import build_dense, tokenizer
from transformers import AutoTokenizer

from hf_ppmoe.utils.chat_template import CHATML, chat_template_text, write_chat_template


def test_names_files_and_text(tmp_path):
    assert chat_template_text("chatml") == CHATML
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert chat_template_text(str(tmp_path / "t.jinja")) == "{{ messages[0]['content'] }}"
    assert chat_template_text("{{ 'x' }}") == "{{ 'x' }}"
    with pytest.raises(ValueError, match="not a known name"):
        chat_template_text("llama9")


def test_write_chat_template_is_what_apply_chat_template_uses(tmp_path):
    tokenizer().save_pretrained(tmp_path)
    write_chat_template(tmp_path, "chatml")
    text = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def hf_ppmoe(*args):
    return subprocess.run([sys.executable, "-m", "hf_ppmoe_cli", *args], capture_output=True, text=True, timeout=600)


def test_upcycle_writes_the_chat_template(tmp_path):
    build_dense("gpt2").save_pretrained(tmp_path / "dense")
    tokenizer().save_pretrained(tmp_path / "dense")
    done = hf_ppmoe("upcycle", str(tmp_path / "dense"), str(tmp_path / "moe"), "--num_experts", "2",
                    "--chat_template", "chatml")
    assert done.returncode == 0, done.stderr
    assert AutoTokenizer.from_pretrained(tmp_path / "moe").chat_template == CHATML


def test_an_unknown_template_is_refused_before_any_work(tmp_path):
    done = hf_ppmoe("upcycle", str(tmp_path / "missing"), str(tmp_path / "moe"), "--chat_template", "llama9")
    assert done.returncode == 2 and "not a known name" in done.stderr
    assert not (tmp_path / "moe").exists()
    done = hf_ppmoe("train", "--chat_template", "llama9", "--output_dir", str(tmp_path / "run"))
    assert done.returncode == 2 and "not a known name" in done.stderr
