"""`hf-ppmoe serve` with a 4-bit model: a folder saved in 4-bit, and a full-precision folder quantized on load with
`--quantization bnb-4bit`. In process (Starlette's test client on the app `hf-ppmoe serve` runs); each answer equals
the in-Python greedy `generate` of the same 4-bit model."""

import pytest
import torch
from converters import tokenizer

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM

pytest.importorskip("fastapi", reason="the serving extra: pip install -e '.[serve]'")
pytest.importorskip("bitsandbytes", reason="quantized experts need bitsandbytes (the test extra)")
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig  # noqa: E402

PROMPT = "def add(a, b):"
MAX_TOKENS = 6
# what `--quantization bnb-4bit` asks of Transformers' server
SERVED_4BIT = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)


def greedy_text(model, folder) -> str:
    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tok(PROMPT)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def served_text(folder, **flags) -> str:
    from fastapi.testclient import TestClient

    from hf_ppmoe.serving import ServeArguments, build_app

    app = build_app(ServeArguments(model=str(folder), device="cpu", dtype="float32", **flags))
    with TestClient(app) as http:
        body = {"model": str(folder), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        answer = http.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["text"]


def test_a_4bit_model_is_served_as_generate_answers(tmp_path):
    tok = tokenizer()
    torch.manual_seed(0)
    # sizes in whole 64-value blocks: bitsandbytes' CPU 4-bit kernels (docs/quantization.md)
    config = GPTMoEConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_experts=4, num_experts_per_tok=2, moe_layer_frequency=1,
                          pad_token_id=tok.pad_token_id)
    GPTMoEForCausalLM(config).save_pretrained(tmp_path / "full")
    tok.save_pretrained(tmp_path / "full")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full", quantization_config=SERVED_4BIT).eval()
    model.save_pretrained(tmp_path / "saved-4bit")  # saved before its Linear4bit layers repack for the CPU kernel
    tok.save_pretrained(tmp_path / "saved-4bit")
    expected = greedy_text(model, tmp_path / "full")
    assert served_text(tmp_path / "full", quantization="bnb-4bit") == expected
    assert served_text(tmp_path / "saved-4bit") == expected


def test_unknown_quantization_flag_is_refused():
    from hf_ppmoe.serving import ServeArguments

    with pytest.raises(ValueError, match="--quantization gptq: must be bnb-4bit or bnb-8bit"):
        ServeArguments(model="unused", quantization="gptq")
