"""GPT-MoE behaves like a Transformers causal LM: cache, padding, attention backends, checkpointing, saving."""

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import GPT2_STYLE, tiny_gpt_config
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments, pipeline

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
from hf_ppmoe.modeling.inputs import routing_token_mask

STYLES = {"llama": dict(), "gpt2": GPT2_STYLE}
GATES = {
    "topk": dict(),
    "switch": dict(router_type="switch", num_experts_per_tok=1),
    "gshard": dict(router_type="gshard", capacity_factor=1.0, eval_capacity_factor=None),
    "prototype": dict(router_type="prototype"),
}


def make_model(style="llama", gate="topk", **overrides):
    return GPTMoEForCausalLM(tiny_gpt_config(**STYLES[style], **GATES[gate], **overrides)).eval()


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("gate", GATES)
def test_generate_with_cache_equals_without(style, gate):
    model = make_model(style, gate)
    ids = torch.randint(3, 97, (2, 5))
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    with_cache = model.generate(ids, use_cache=True, **kw)
    without = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(with_cache, without)
    # and incremental logits equal a full forward
    full = model(with_cache).logits[:, -1]
    out = model(with_cache[:, :-1], use_cache=True)
    step = model(with_cache[:, -1:], cache=out.cache).logits[:, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("style", STYLES)
def test_left_padding_does_not_change_generation(style):
    model = make_model(style)
    short, long = torch.randint(3, 97, (1, 3)), torch.randint(3, 97, (1, 6))
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = (torch.arange(6) >= 3).long().unsqueeze(0).repeat(2, 1)
    mask[1] = 1
    kw = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    batched = model.generate(batch, attention_mask=mask, **kw)
    assert torch.equal(batched[0, 3:], model.generate(short, **kw)[0])
    assert torch.equal(batched[1], model.generate(long, **kw)[0])


@pytest.mark.parametrize("style", STYLES)
def test_aux_and_outputs_unchanged_by_padding(style):
    model = make_model(style, router_z_loss_coef=0.01)
    ids = torch.randint(3, 97, (1, 7))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 7)], 1).long()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    a = model(ids, labels=ids)
    b = model(padded, attention_mask=mask, position_ids=position_ids)
    torch.testing.assert_close(b.logits[:, 4:], a.logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(b.aux_loss, a.aux_loss)
    torch.testing.assert_close(b.z_loss, a.z_loss)


def test_inference_routes_padding_nowhere_and_skips_a_mask_without_padding():
    """Without router losses the model drops a mask that has no padding (one check per forward, not per layer); a
    mask with padding still routes the padding nowhere, so it takes no expert capacity from real tokens."""
    torch.manual_seed(0)
    model = make_model(eval_capacity_factor=0.5)
    ids = torch.randint(3, 97, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    calls = []
    hook = model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: calls.append((args[0], out[1])))
    with torch.no_grad():
        model(ids, attention_mask=mask)
        full = model(ids, attention_mask=torch.ones_like(ids))
        unmasked = model(ids)
    hook.remove()
    (h, routing), E = calls[0], model.config.num_experts
    assert routing.aux_loss is None  # inference: no losses were computed
    assert (routing.expert_ids.view(2, 7, -1)[0, :3] == E).all() and (routing.weights.view(2, 7, -1)[0, :3] == 0).all()
    gate = model.model.layers[0].mlp.gate
    with torch.no_grad():
        masked = gate(h.view(14, -1), mask.view(-1).bool(), compute_losses=False)
        routed_padding = gate(h.view(14, -1), None, compute_losses=False)
    assert torch.equal(routing.expert_ids, masked.expert_ids)
    real = mask.view(-1).bool()
    assert not torch.equal(routed_padding.expert_ids[real], masked.expert_ids[real])  # padding would take slots
    assert torch.equal(full.logits, unmasked.logits) and torch.equal(calls[1][1].expert_ids, calls[2][1].expert_ids)
    # the skip itself: only inference drops a mask, and only one without padding
    ones = torch.ones_like(ids)
    assert routing_token_mask(ones, compute_router_losses=False) is None
    assert routing_token_mask(ones, compute_router_losses=True) is ones
    assert routing_token_mask(mask, compute_router_losses=False) is mask


def test_loss_adds_router_losses_with_their_coefficients():
    model = make_model(router_aux_loss_coef=0.5, router_z_loss_coef=0.25)
    ids = torch.randint(3, 97, (2, 6))
    out = model(ids, labels=ids)
    lm = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, lm + 0.5 * out.aux_loss + 0.25 * out.z_loss)


def test_router_logits_in_output_agree_with_the_gates():
    model = make_model(num_hidden_layers=4, moe_layer_frequency=2)
    ids = torch.randint(3, 97, (2, 5))
    out = model(ids, output_router_logits=True, output_hidden_states=True)
    moe_layers = [i for i, layer in enumerate(model.model.layers) if layer.is_moe]
    assert moe_layers == [1, 3] and len(out.router_logits) == 2
    for logits, ids_out, i in zip(out.router_logits, out.router_expert_ids, moe_layers):
        layer = model.model.layers[i]
        h = layer.post_attention_layernorm(out.hidden_states[i] + layer.self_attn(
            layer.input_layernorm(out.hidden_states[i]),
            position_embeddings=model.model.rotary_emb(out.hidden_states[i], torch.arange(5)[None]),
            attention_mask=None,
        )[0])
        routing = layer.mlp.gate(h.reshape(-1, 32))
        torch.testing.assert_close(logits, routing.router_logits, atol=1e-5, rtol=1e-4)
        assert torch.equal(ids_out, routing.expert_ids)


@pytest.mark.parametrize("style", STYLES)
def test_eager_and_sdpa_agree(style):
    model = make_model(style)
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    model.set_attn_implementation("eager")
    eager = model(ids, attention_mask=mask).logits
    model.set_attn_implementation("sdpa")
    sdpa = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(eager[:, 3:], sdpa[:, 3:], atol=1e-5, rtol=1e-4)


def test_sliding_window_limits_attention():
    full = make_model(num_hidden_layers=1)
    windowed = make_model(num_hidden_layers=1, sliding_window=3)
    windowed.load_state_dict(full.state_dict())
    ids = torch.randint(3, 97, (1, 8))
    a, b = full(ids).logits, windowed(ids).logits
    torch.testing.assert_close(a[:, :3], b[:, :3])
    assert not torch.allclose(a[:, 3:], b[:, 3:])


def test_gradient_checkpointing_gives_the_same_gradients():
    model = make_model(gate="gshard", hidden_dropout=0.1).train()
    ids = torch.randint(3, 97, (2, 8))

    def grads():
        model.zero_grad()
        torch.manual_seed(1)
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.activation_checkpointing_enable()
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], msg=name)


def test_tied_embeddings():
    model = make_model("gpt2")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert make_model("llama").lm_head.weight is not make_model("llama").model.embed_tokens.weight


SAVE_AND_COMPARE = """
import sys, torch
{blocker}
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code={trust}).eval()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code={trust})  # it reads the config too (docs/models.md)
assert tokenizer.decode(tokenizer("def add(a, b):")["input_ids"]) == "def add(a, b):"
ids, expected = torch.load(sys.argv[2])
assert type(model).__module__.startswith({module!r}), type(model).__module__
assert torch.equal(model(ids).logits, expected), "logits differ"
tokens = model.generate(ids, max_new_tokens=3, do_sample=False)
print("OK", tokens.shape[1])
"""


@pytest.mark.parametrize("remote", [False, True], ids=["installed", "trust_remote_code_without_hf_ppmoe"])
def test_save_load_round_trip_in_a_fresh_process(tmp_path, remote):
    from converters import tokenizer

    model = make_model("gpt2", "gshard")
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer().save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(3, 97, (2, 6))
    torch.save((ids, model(ids).logits), tmp_path / "expected.pt")
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"config.json", "model.safetensors", "modeling_gpt_moe.py", "configuration_gpt_moe.py", "moe_layer.py"} <= files
    blocker = "sys.modules['hf_ppmoe'] = None  # hf_ppmoe cannot be imported" if remote else "import hf_ppmoe"
    script = SAVE_AND_COMPARE.format(
        blocker=blocker, trust=remote, module="transformers_modules" if remote else "hf_ppmoe"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "ckpt"), str(tmp_path / "expected.pt")],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,  # Transformers' "run the custom code? [y/N]" would read no, and fail the load
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HF_HOME": str(tmp_path / "hf_home"),
             "OMP_NUM_THREADS": str(torch.get_num_threads())},  # bit-equal logits need the same thread count
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK 9" in result.stdout and "Do you wish to run the custom code" not in result.stdout + result.stderr


def test_saved_remote_code_can_be_saved_again(tmp_path):
    """A model loaded through trust_remote_code saves a folder that loads again the same way."""
    model = make_model()
    model.save_pretrained(tmp_path / "a")
    ids = torch.randint(3, 97, (1, 4))
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.modules['hf_ppmoe'] = None
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'a')!r}, trust_remote_code=True)
        m.save_pretrained({str(tmp_path / 'b')!r})
        m2 = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'b')!r}, trust_remote_code=True)
        ids = torch.tensor({ids.tolist()})
        assert torch.equal(m.eval()(ids).logits, m2.eval()(ids).logits)
        print("OK")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HF_HOME": str(tmp_path / "hf_home"),
             "OMP_NUM_THREADS": str(torch.get_num_threads())},  # bit-equal logits need the same thread count
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_failed_save_leaves_the_previous_checkpoint_untouched(tmp_path, monkeypatch):
    model = make_model()
    model.save_pretrained(tmp_path / "ckpt")
    def contents():
        return {str(p.relative_to(tmp_path)): p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}

    before = contents()

    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", explode)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(tmp_path / "ckpt")
    assert contents() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging folder left behind


def test_auto_classes_and_sharded_save(tmp_path):
    model = make_model()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert isinstance(AutoConfig.from_pretrained(tmp_path), GPTMoEConfig)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, GPTMoEForCausalLM)
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n


def test_text_generation_pipeline_and_trainer(tmp_path):
    model = make_model()
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{c: i + 3 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    gen = pipeline("text-generation", model=model, tokenizer=tok)
    out = gen("hello world", max_new_tokens=4, do_sample=False)
    assert out[0]["generated_text"].startswith("hello world")

    data = [{"input_ids": torch.randint(3, 30, (12,)).tolist()} for _ in range(8)]
    for row in data:
        row["labels"] = row["input_ids"]
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, report_to=[], use_cpu=True,
        logging_steps=1, save_strategy="no",
    )
    trainer = Trainer(model=model.train(), args=args, train_dataset=data)
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))


@pytest.mark.parametrize("gate", [dict(router_type="topk"), dict(router_type="prototype")])
def test_active_parameters_equal_the_dense_model_of_equal_active_flops_plus_routers(gate):
    """k experts of inner size f run per token: the parameters a token touches are those of the dense model with
    inner size k * f, plus each MoE layer's router [E, H]; a shared expert always runs."""
    moe = GPTMoEForCausalLM(tiny_gpt_config(**gate, shared_expert_intermediate_size=8))
    dense = GPTMoEForCausalLM(tiny_gpt_config(intermediate_size=2 * 48, moe_layers=[]))
    shared = 2 * 3 * 32 * 8  # two layers' shared SwiGLU experts
    routers = 2 * 4 * 32
    assert moe.num_active_parameters() == dense.num_parameters() + routers + shared
    assert moe.num_parameters() - moe.num_active_parameters() == 2 * 2 * 3 * 32 * 48  # 2 idle experts per layer
    assert "num_experts=4, top_k=2" in repr(moe) and "intermediate_size=48" in repr(moe)


def test_qk_norm_is_off_by_default_and_normalises_each_head():
    """qk_norm adds only Qwen3's two [head_dim] norms per layer (default off: existing checkpoints keep their tensors),
    and they normalise each query / key head: scaling a head's projection rows leaves the logits unchanged (their
    place before the rotary embedding is checked by the logits equal to Transformers' Qwen3 / Qwen3-MoE in
    tests/conversion)."""
    plain, normed = make_model(), make_model(qk_norm=True)
    extra = set(normed.state_dict()) - set(plain.state_dict())
    assert extra == {f"model.layers.{i}.self_attn.{x}_norm.weight" for i in range(2) for x in "qk"}
    assert plain.model.layers[0].self_attn.q_norm is None
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        expected = normed(ids).logits
        attn = normed.model.layers[0].self_attn
        attn.q_proj.weight[:8] *= 3.0  # head 0 of the queries (head_dim 8)
        attn.k_proj.weight[8:16] *= 0.5  # head 1 of the keys
        torch.testing.assert_close(normed(ids).logits, expected, atol=1e-5, rtol=1e-5)
