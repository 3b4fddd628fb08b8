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


def test_chat_without_template_is_a_clear_400_the_openai_client_shows(tmp_path):
    """The app in this process (uvicorn in a thread, on 127.0.0.1), asked through the OpenAI client as the docs do:
    the refusal names the fix in OpenAI's error body, whose message the client's exception carries (FastAPI's
    {"detail": ...} reached it as "Error code: 400" alone); completions still work."""
    import threading

    import uvicorn

    from hf_ppmoe.serving import ServeArguments, build_app

    folder = save_tiny_model(tmp_path / "model", chat_template=None)
    app = build_app(ServeArguments(model=str(folder), device="cpu", dtype="float32"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        api = client(f"http://127.0.0.1:{port}/v1")
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(model=str(folder), messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert "no chat template" in refused.value.message and "--chat_template" in refused.value.message
        assert refused.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError, match="pinned to"):  # Transformers' own refusals too
            api.completions.create(model="another-model", prompt="def", max_tokens=2)
        assert api.completions.create(model=str(folder), prompt="def", max_tokens=2).choices[0].text is not None
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def test_a_model_that_is_nowhere_is_one_line_at_once(tmp_path, monkeypatch):
    """Issue 46: `hf-ppmoe serve no-such-model` retried the Hub for a minute and ended in a 67-line traceback. A path
    that can only be local, and a name in no local folder and no cache, are one line, with the Hub asked once."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"))
    for model, words in ((str(tmp_path / "no-such"), "no such folder."),
                         ("no-such-model", "no model of that name in the local Hub cache")):
        result = subprocess.run([sys.executable, "-m", "hf_ppmoe_cli", "serve", model, "--host", "127.0.0.1"],
                                capture_output=True, text=True, timeout=300, env=env)
        lines = result.stderr.splitlines()
        assert result.returncode == 2 and result.stdout == "" and len(lines) == 1, result
        assert lines[0].startswith(f"hf-ppmoe serve: error: MODEL {model}: ") and words in lines[0], lines

    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    from hf_ppmoe.serving import model_problem

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    asked = []

    def unreachable(self, repo, **kwargs):
        asked.append(repo)
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    assert model_problem("no-such-model") == ("MODEL no-such-model: no such folder, and the Hub cannot be reached to "
                                              "look for one (ConnectionError: [Errno -2] Name or service not known).")
    assert asked == ["no-such-model"]  # once: no retries

    def unknown(self, repo, **kwargs):
        from types import SimpleNamespace

        raise RepositoryNotFoundError("404 Client Error: Repository Not Found", response=SimpleNamespace(headers={}, request=None))

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unknown)
    assert "no model of that name on the Hub" in model_problem("user/no-such-model")
    assert model_problem(str(tmp_path)) is None  # a folder: for the loader to read
