"""`hf-ppmoe serve MODEL`: Transformers' own OpenAI-compatible server (`transformers serve`: FastAPI + uvicorn, its
model manager, its handlers for /v1/completions and /v1/chat/completions, continuous batching with a paged cache)
serving our models, and the chat template a folder needs for chat completions.

What this module adds to `transformers serve`, and nothing else:

- our classes where its model manager looks them up: it loads `getattr(transformers, config.architectures[0])`, so
  `expose_model_classes` puts GPTMoEForCausalLM and Seq2SeqMoEForConditionalGeneration on the `transformers` module
  (`hf_ppmoe.utils.transformers_private.expose_on_transformers`);
- a MODEL that names nothing to load is one line, at once (`model_problem`), where Transformers' loader retries an
  unreachable Hub for a minute and ends in a traceback;
- a chat request to a model whose tokenizer has no chat template answers HTTP 400 naming the fix, where Transformers'
  handler fails inside `apply_chat_template` with a 500 (`chat_completions_handler`);
- refusals in OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, whose message OpenAI's clients
  show (`openai_error`; FastAPI's `{"detail": ...}` reaches them as "Error code: 400" alone);
- continuous batching on by default, with a paged cache sized for the device (`cache_config`);
- a clear refusal for an encoder-decoder (Seq2Seq-MoE), which Transformers' server does not handle
  (`SEQ2SEQ_NOT_SERVED`).

Router statistics are not part of the OpenAI protocol: a user who wants them calls `model.generate(...,
output_router_logits=True, return_dict_in_generate=True)` in Python (docs/generation.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from .utils.chat_template import CHAT_TEMPLATES, write_chat_template

NO_CHAT_TEMPLATE = (
    "This model's tokenizer has no chat template, so /v1/chat/completions cannot turn messages into a prompt. Use "
    "/v1/completions with a plain prompt, or give the folder a template: `hf-ppmoe upcycle ... --chat_template chatml` "
    "(or a .jinja file), or `hf_ppmoe.utils.chat_template.write_chat_template(folder, 'chatml')`."
)
SEQ2SEQ_NOT_SERVED = (
    "{model} is an encoder-decoder (Seq2Seq-MoE): Transformers' server (5.24) handles decoder-only models (its "
    "completion handlers cut the prompt's length off the generated sequence, which for an encoder-decoder holds the "
    "decoder's tokens only, and its continuous batching has no place for an encoder's output). Generate with "
    "model.generate(...) in Python (docs/seq2seq.md)."
)
# Transformers sizes the default paged cache for an accelerator (8192 tokens a batch and an attention mask to match):
# on a CPU that mask alone makes every step slow, so a CPU server starts with a small cache unless told otherwise
CPU_CACHE = dict(num_blocks=64, max_batch_tokens=256, page_size=32)


@dataclass
class ServeArguments:
    """`hf-ppmoe serve MODEL [options]`; the options are those of `transformers serve` (`--cb_page_size`: its
    `--cb-block-size`, by the name its cache config uses now)."""

    model: str = field(metadata={"help": "Folder (or Hub id) written by save_pretrained / hf-ppmoe upcycle|train."})
    host: str = field(default="localhost", metadata={"help": "Listen address (127.0.0.1 / localhost: this machine only)."})
    port: int = field(default=8000, metadata={"help": "Listen port."})
    continuous_batching: bool = field(default=True, metadata={"help": "Continuous batching with a paged cache."})
    device: str = field(default="auto", metadata={"help": "Device: auto, cpu, cuda:0, ..."})
    dtype: str = field(default="auto", metadata={"help": "Weights' dtype: auto (as saved), bfloat16, float32, ..."})
    attn_implementation: str | None = field(default=None, metadata={"help": "Attention kernel: sdpa, eager, flash_attention_2, ..."})
    quantization: str | None = field(default=None, metadata={"help": "Quantize on load: bnb-4bit (NF4) or bnb-8bit, experts included (a folder saved quantized needs none)."})
    cb_num_blocks: int | None = field(default=None, metadata={"help": "Paged cache blocks (default: Transformers' sizing; on CPU 64)."})
    cb_page_size: int | None = field(default=None, metadata={"help": "Tokens per paged cache page (on CPU default 32)."})
    cb_max_batch_tokens: int | None = field(default=None, metadata={"help": "Tokens a batch holds (on CPU default 256)."})
    log_level: str = field(default="warning", metadata={"help": "Logging level: info, warning, error."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Also run other models' remote code (ours needs none)."})

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"--port {self.port}: must be between 1 and 65535")
        if self.quantization not in (None, "bnb-4bit", "bnb-8bit"):
            raise ValueError(f"--quantization {self.quantization}: must be bnb-4bit or bnb-8bit")


def expose_model_classes() -> None:
    """Our model classes on the `transformers` module, where `transformers serve`'s model manager finds a
    checkpoint's architecture (and with `import hf_ppmoe`, which registers them with the Auto classes)."""
    import hf_ppmoe

    from .utils.transformers_private import expose_on_transformers

    expose_on_transformers(hf_ppmoe.GPTMoEForCausalLM, hf_ppmoe.Seq2SeqMoEForConditionalGeneration)


def model_problem(model: str) -> str | None:
    """Why MODEL names no model to load, in one line, or None: a local folder, else a Hub repository (`repo` or
    `repo@revision`) in the local cache or on the Hub, asked once without retries."""
    from .utils.paths import path_problem

    repo, _, revision = model.split(":", 1)[0].partition("@")  # Transformers' `repo@revision` and `repo:file.gguf`
    if Path(repo).is_dir():
        return None
    if problem := path_problem(repo, "model", "MODEL"):  # a path that can only be local, or no repository id
        return problem
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(try_to_load_from_cache(repo, "config.json", revision=revision or None), str):
        return None
    missing = f"MODEL {model}: no such folder"
    if constants.HF_HUB_OFFLINE:
        return f"{missing}, and no model of that name in the local Hub cache (HF_HUB_OFFLINE is set)."
    try:
        HfApi().model_info(repo, revision=revision or None, timeout=10)
    except (RepositoryNotFoundError, RevisionNotFoundError):
        return f"{missing}, and no model of that name on the Hub (a private one: log in with `hf auth login`)."
    except Exception as error:  # no network, a refused token, a time-out: the loader would fail on it too
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        return f"{missing}, and the Hub cannot be reached to look for one ({reason})."
    return None


def is_decoder_only(model: str) -> bool:
    from transformers import AutoConfig

    import hf_ppmoe  # noqa: F401  (our model types)

    return not getattr(AutoConfig.from_pretrained(model), "is_encoder_decoder", False)


def cache_config(args: ServeArguments):
    """The paged cache of continuous batching: the flags given, else Transformers' sizing (on CPU: `CPU_CACHE`)."""
    from transformers import ContinuousBatchingConfig

    given = {"num_blocks": args.cb_num_blocks, "page_size": args.cb_page_size, "max_batch_tokens": args.cb_max_batch_tokens}
    on_cpu = args.device == "cpu" or (args.device == "auto" and not _has_accelerator())
    sizes = {**(CPU_CACHE if on_cpu else {}), **{k: v for k, v in given.items() if v is not None}}
    return ContinuousBatchingConfig(**sizes) if sizes else None


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def build_app(args: ServeArguments):
    """Transformers' FastAPI app (`transformers.cli.serving.server.build_server`) with its own model manager,
    generation state and handlers, pinned to `args.model`; chat requests go through `chat_completions_handler()`."""
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.systemone import SystemOneHandler
    from transformers.cli.serving.transcription import TranscriptionHandler
    from transformers.cli.serving.utils import GenerationState
    from transformers.utils import logging

    expose_model_classes()
    if not is_decoder_only(args.model):
        raise ValueError(SEQ2SEQ_NOT_SERVED.format(model=args.model))
    logging.get_logger("transformers").setLevel(logging.log_levels[args.log_level.lower()])
    batching = args.continuous_batching
    manager = ModelManager(
        device=args.device,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        attn_implementation=args.attn_implementation,
        continuous_batching=batching,
        quantization=args.quantization,
        force_model=args.model,
    )
    state = GenerationState(continuous_batching=batching, compile=False, cb_config=cache_config(args) if batching else None)
    app = build_server(
        manager,
        chat_completions_handler()(manager, state),
        completion_handler=CompletionHandler(manager, state),
        response_handler=ResponseHandler(manager, state),
        transcription_handler=TranscriptionHandler(manager, state),
        systemone_handler=SystemOneHandler(manager, state),
        generation_state=state,
    )
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    app.add_exception_handler(HTTPException, openai_error)
    app.add_exception_handler(RequestValidationError, openai_error)
    return app


async def openai_error(request, error):
    """An HTTP error (ours, Transformers' handlers', a malformed body) in OpenAI's error body."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    status = 422 if isinstance(error, RequestValidationError) else error.status_code
    message = str(error.errors()) if isinstance(error, RequestValidationError) else str(error.detail)
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=status, headers=getattr(error, "headers", None))


@functools.cache
def chat_completions_handler() -> type:
    """Transformers' handler of /v1/chat/completions, answering 400 with `NO_CHAT_TEMPLATE` for a tokenizer without a
    chat template (its own handler raises inside `apply_chat_template`: a 500). Built on first use, so that
    `hf-ppmoe serve --help` answers before torch and Transformers are imported."""
    from fastapi import HTTPException
    from transformers.cli.serving.chat_completion import ChatCompletionHandler

    class ChatCompletions(ChatCompletionHandler):
        async def handle_request(self, body: dict, request_id: str):
            self._validate_request(body)
            _, _, processor = self._resolve_model(dict(body))  # loaded once, then cached by the model manager
            if getattr(processor, "chat_template", None) is None:
                raise HTTPException(status_code=400, detail=NO_CHAT_TEMPLATE)
            return await super().handle_request(body, request_id)

    return ChatCompletions


def serve(args: ServeArguments) -> None:
    """Run the server until interrupted (Ctrl-C, SIGTERM). ValueError: refused before listening."""
    if problem := model_problem(args.model):
        raise ValueError(problem)
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise ValueError("serving needs fastapi, uvicorn, openai and pydantic (Transformers' `serving` extra): "
                         "pip install -e '.[serve]' in the clone, or pip install 'transformers[serving]'.")
    import uvicorn

    if args.host not in ("localhost", "127.0.0.1", "::1"):
        print(f"hf-ppmoe serve: listening on {args.host}: reachable from other machines, with no authentication.")
    uvicorn.run(build_app(args), host=args.host, port=args.port, log_level=args.log_level.lower())


__all__ = ["CHAT_TEMPLATES", "ServeArguments", "build_app", "expose_model_classes", "model_problem", "openai_error", "serve",
           "write_chat_template"]
