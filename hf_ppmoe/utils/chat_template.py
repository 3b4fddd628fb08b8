"""Chat templates a model folder can be given (`hf-ppmoe upcycle|train --chat_template ...`), so that
`tokenizer.apply_chat_template` and an OpenAI server's /v1/chat/completions (`hf-ppmoe serve`) can turn messages
into a prompt. A template is a name below, a path to a Jinja file, or the Jinja text itself."""

from __future__ import annotations

from pathlib import Path

# ChatML (Qwen's and many fine-tunes' format): "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then the
# assistant's header when a reply is wanted
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT_TEMPLATES = {"chatml": CHATML}


def chat_template_text(template: str) -> str:
    """The Jinja text of `template`: a name in `CHAT_TEMPLATES`, a path to a file, or Jinja text."""
    if template in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[template]
    if template.endswith(".jinja") or Path(template).is_file():
        return Path(template).read_text(encoding="utf-8")
    if "{%" in template or "{{" in template:
        return template
    raise ValueError(
        f"chat template {template!r} is not a known name ({', '.join(CHAT_TEMPLATES)}), a file, or Jinja text."
    )


def write_chat_template(folder: str | Path, template: str) -> None:
    """Give the tokenizer saved in `folder` the chat template `template`, saved beside it (chat_template.jinja)."""
    from transformers import AutoTokenizer

    text = chat_template_text(template)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = text
    tokenizer.save_pretrained(folder)
