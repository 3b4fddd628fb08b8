"""`hf-ppmoe serve`: Transformers' OpenAI-compatible server with our classes, talked to with the `openai` client as
docs/serving.md shows. The server runs on 127.0.0.1 in its own process, started and stopped here by its process id;
every request has a bounded timeout. Its answers equal `generate`'s greedy output for the same prompt."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from converters import tokenizer
from helpers import tiny_gpt_config

from hf_ppmoe import GPTMoEForCausalLM

openai = pytest.importorskip("openai", reason="the serving extra: pip install -e '.[serve]'")
pytest.importorskip("fastapi", reason="the serving extra: pip install -e '.[serve]'")

MAX_TOKENS = 8
START_TIMEOUT_S = 240  # import + model load on a busy two-core machine
REQUEST_TIMEOUT_S = 120


def save_tiny_model(folder, chat_template: str | None):
    from hf_ppmoe.serving import write_chat_template

    tok = tokenizer()
    torch.manual_seed(0)
    config = tiny_gpt_config(vocab_size=len(tok), pad_token_id=tok.pad_token_id or 0, eos_token_id=None, bos_token_id=None)
    GPTMoEForCausalLM(config).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    if chat_template:
        write_chat_template(folder, chat_template)
    return folder


def greedy_text(folder, ids: list[int], max_tokens: int = MAX_TOKENS) -> str:
    from transformers import AutoTokenizer

    model = GPTMoEForCausalLM.from_pretrained(folder).eval()
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_tokens, do_sample=False)
    return AutoTokenizer.from_pretrained(folder).decode(out[0, len(ids):], skip_special_tokens=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(folder, base_url) of a running `hf-ppmoe serve` on 127.0.0.1; stopped by its pid afterwards."""
    folder = save_tiny_model(tmp_path_factory.mktemp("served") / "model", chat_template="chatml")
    port = free_port()
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "hf_ppmoe_cli", "serve", str(folder), "--host", "127.0.0.1", "--port", str(port),
         "--device", "cpu", "--dtype", "float32"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                log.seek(0)
                pytest.fail(f"hf-ppmoe serve exited with {process.returncode}:\n{log.read()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:  # not listening yet (URLError, connection refused, timeout)
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"hf-ppmoe serve did not answer /health within {START_TIMEOUT_S} s")
            time.sleep(1)
        yield folder, f"http://127.0.0.1:{port}/v1"
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        log.close()


def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def expected_completion(folder, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    return greedy_text(folder, tokenizer()(prompt)["input_ids"], max_tokens)


def expected_chat(folder, messages, max_tokens: int = MAX_TOKENS) -> str:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return greedy_text(folder, list(ids["input_ids"] if hasattr(ids, "keys") else ids), max_tokens)


def test_completion_equals_greedy_generate(server):
    folder, base_url = server
    prompt = "def add(a, b):"
    answer = client(base_url).completions.create(model=str(folder), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert answer.choices[0].text == expected_completion(folder, prompt)


def test_chat_completion_equals_greedy_generate(server):
    folder, base_url = server
    messages = [{"role": "user", "content": "The for statement iterates"}]
    answer = client(base_url).chat.completions.create(
        model=str(folder), messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert answer.choices[0].message.content == expected_chat(folder, messages)


def test_the_docs_client_snippet(server, capsys):
    """docs/serving.md's client snippet, as written, against this server: it prints generate's greedy answers."""
    folder, base_url = server
    doc = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    snippet = re.search(r"## The client\n\n(?:<!-- skip:[^\n]*-->\n)?```python\n(.*?)```", doc, re.S).group(1)
    assert "http://localhost:8000/v1" in snippet and "path/to/model" in snippet
    exec(snippet.replace("http://localhost:8000/v1", base_url).replace("path/to/model", str(folder)), {})
    printed = capsys.readouterr().out
    completion = expected_completion(folder, "def add(a, b):", 16)
    chat = expected_chat(folder, [{"role": "user", "content": "Say hello."}], 16)
    assert printed == f"{completion}\n{chat}\n"


def test_an_encoder_decoder_is_refused_with_the_reason(tmp_path):
    from helpers import tiny_seq2seq_config

    from hf_ppmoe import Seq2SeqMoEForConditionalGeneration
    from hf_ppmoe.serving import ServeArguments, build_app

    Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="encoder-decoder"):
        build_app(ServeArguments(model=str(tmp_path), device="cpu"))


def test_chat_without_template_is_a_clear_400(tmp_path):
    """In-process (Starlette's test client on the same app): the refusal names the fix, no stack trace."""
    from fastapi.testclient import TestClient

    from hf_ppmoe.serving import ServeArguments, build_app

    folder = save_tiny_model(tmp_path / "model", chat_template=None)
    app = build_app(ServeArguments(model=str(folder), device="cpu", dtype="float32"))
    with TestClient(app) as http:
        body = {"model": str(folder), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400
        assert "no chat template" in response.json()["detail"] and "--chat_template" in response.json()["detail"]
        completion = http.post("/v1/completions", json={"model": str(folder), "prompt": "def", "max_tokens": 2})
        assert completion.status_code == 200, completion.text
