"""HF <-> Megatron-LM checkpoints (hf_ppmoe.megatron.weights): bit-exact round trips for TP and PP shardings, the
on-disk layout Megatron-LM's loader expects, tensor layouts, and clear errors. Needs no megatron-core (its model
built from these files is tested against ours in test_megatron_model.py)."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import GPT2_STYLE, tiny_gpt_config

from hf_ppmoe import GPTMoEForCausalLM
from hf_ppmoe.megatron.__main__ import megatron_main as main
from hf_ppmoe.megatron.weights import (
    ConversionError,
    InterleaveQKV,
    checkpoint_args,
    from_megatron,
    load_megatron_checkpoint,
    save_megatron_checkpoint,
    to_megatron,
)

CONFIGS = {
    "llama": dict(qk_norm=True),  # Qwen3's per-head q/k norms: q_layernorm / k_layernorm, replicated over TP ranks
    "gpt2": dict(GPT2_STYLE, router_type="switch", num_experts_per_tok=1),
    "qwen": dict(
        attention_bias=True, attention_output_bias=False, moe_layer_frequency=2, shared_expert_intermediate_size=32
    ),
}
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def model(name="llama", **overrides):
    return GPTMoEForCausalLM(tiny_gpt_config(**{**CONFIGS[name], "num_hidden_layers": 4, **overrides}))


def assert_same(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("name", CONFIGS)
def test_round_trip_through_megatron_files_is_bit_exact(tmp_path, name, tp, pp):
    m = model(name)
    sd = m.state_dict()
    save_megatron_checkpoint(
        to_megatron(sd, m.config, tp=tp, pp=pp), tmp_path / "ckpt", checkpoint_args(m.config, tp=tp, pp=pp)
    )
    shards, args = load_megatron_checkpoint(tmp_path / "ckpt")
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
    assert_same(from_megatron(shards, m.config, tp=tp, pp=pp), sd)


def test_files_are_laid_out_as_megatron_lm_names_them(tmp_path):
    m = model("gpt2")
    save_megatron_checkpoint(
        to_megatron(m.state_dict(), m.config, tp=2, pp=2), tmp_path / "c", checkpoint_args(m.config, tp=2, pp=2)
    )
    assert (tmp_path / "c" / "latest_checkpointed_iteration.txt").read_text() == "release"
    # mp_rank_{tp}_{pp}_{ep}: the expert rank is the tensor rank (experts on the TP group)
    assert sorted(p.name for p in (tmp_path / "c" / "release").iterdir()) == [
        "mp_rank_00_000_000",
        "mp_rank_00_001_000",
        "mp_rank_01_000_001",
        "mp_rank_01_001_001",
    ]
    record = torch.load(tmp_path / "c/release/mp_rank_01_001_001/model_optim_rng.pt", weights_only=False)
    assert record["checkpoint_version"] == 3.0 and record["iteration"] == 0
    a = record["args"]
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.expert_model_parallel_size) == (2, 2, 2)
    assert a.expert_tensor_parallel_size == 1 and a.padded_vocab_size == 256 and a.ckpt_format == "torch"
    sd = record["model"]
    # last stage of a tied model: layers 2, 3 renumbered 0, 1; a copy of the embedding as output layer; Megatron's
    # linear layers carry an (empty) extra state that its strict loading expects
    assert (
        "decoder.layers.1.self_attention.linear_qkv.weight" in sd
        and "decoder.layers.2.input_layernorm.weight" not in sd
    )
    assert sd["output_layer.weight"].shape == (128, 32) and "embedding.word_embeddings.weight" not in sd
    assert (
        sd["output_layer._extra_state"] is None
        and sd["decoder.layers.0.self_attention.linear_proj._extra_state"] is None
    )
    assert "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.bias" in sd  # experts 2, 3 live on TP rank 1
    assert "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight" not in sd


def test_dense_model_has_no_expert_rank_in_file_names(tmp_path):
    m = model(moe_layers=[])
    save_megatron_checkpoint(
        to_megatron(m.state_dict(), m.config, tp=2), tmp_path / "c", checkpoint_args(m.config, tp=2, pp=1)
    )
    assert sorted(p.name for p in (tmp_path / "c/release").iterdir()) == ["mp_rank_00", "mp_rank_01"]


def test_tensor_layouts():
    """Megatron's conventions, by value: per-KV-group q/k/v interleave, gated fc1 per rank, experts by rank, padding."""
    q, k, v = torch.arange(4.0).view(4, 1), torch.tensor([[10.0], [11.0]]), torch.tensor([[20.0], [21.0]])
    (qkv,) = InterleaveQKV(heads=4, groups=2, head_dim=1)([q, k, v])
    assert qkv.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]

    m = model("llama", num_hidden_layers=2, moe_layer_frequency=2)  # layer 0 dense, layer 1 MoE
    sd = m.state_dict()
    shards = to_megatron(sd, m.config, tp=2)
    gate, up = sd["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"]  # [48, 32]
    assert torch.equal(shards[(1, 0)]["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[24:], up[24:]]))
    assert torch.equal(
        shards[(0, 0)]["decoder.layers.0.mlp.linear_fc2.weight"], sd["model.layers.0.mlp.down_proj.weight"][:, :24]
    )
    experts = sd["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, H], as nn.Linear
    assert torch.equal(shards[(1, 0)]["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"], experts[2])
    embedding = shards[(1, 0)]["embedding.word_embeddings.weight"]  # vocab 97 padded to 256, rows 128.. on rank 1
    assert embedding.shape == (128, 32) and not embedding.any()


def test_conversion_errors_name_the_problem(tmp_path):
    m = model()
    sd = m.state_dict()
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ConversionError, match="missing.*model.layers.1.self_attn.k_proj.weight"):
        to_megatron(missing, m.config)
    with pytest.raises(ConversionError, match=r"wrong shape.*model.norm.weight: \[31\]"):
        to_megatron({**sd, "model.norm.weight": torch.ones(31)}, m.config)
    with pytest.raises(ConversionError, match="unexpected.*extra.weight"):
        to_megatron({**sd, "extra.weight": torch.ones(1)}, m.config)
    with pytest.raises(ConversionError, match="num_experts=4 is not divisible by TP=3"):
        to_megatron(sd, m.config, tp=3)
    with pytest.raises(ValueError, match="router_type='gshard'"):
        bad = model(router_type="gshard")
        to_megatron(bad.state_dict(), bad.config)

    shards = to_megatron(sd, m.config, tp=2, pp=2)
    shards[(1, 1)]["decoder.final_layernorm.weight"] = shards[(1, 1)]["decoder.final_layernorm.weight"] + 1
    with pytest.raises(ConversionError, match="decoder.final_layernorm.weight is replicated.*rank 1 differs"):
        from_megatron(shards, m.config, tp=2, pp=2)
    del shards[(0, 1)]["decoder.layers.0.mlp.router.weight"]
    with pytest.raises(ConversionError, match="ranks 0 and 1 hold different tensors.*router"):
        from_megatron(shards, m.config, tp=2, pp=2)
    with pytest.raises(ConversionError, match=r"missing shards.*\(1, 1\)"):
        from_megatron({key: s for key, s in shards.items() if key != (1, 1)}, m.config, tp=2, pp=2)

    save_megatron_checkpoint(to_megatron(sd, m.config, tp=2), tmp_path / "c", checkpoint_args(m.config, tp=2, pp=1))
    with pytest.raises(FileExistsError):
        save_megatron_checkpoint(to_megatron(sd, m.config), tmp_path / "c", checkpoint_args(m.config, tp=1, pp=1))
    (tmp_path / "c/release/mp_rank_01_001/model_optim_rng.pt").unlink()
    with pytest.raises(ConversionError, match="missing release/mp_rank_01_001/model_optim_rng.pt"):
        load_megatron_checkpoint(tmp_path / "c")
    with pytest.raises(ConversionError, match="no latest_checkpointed_iteration.txt"):
        load_megatron_checkpoint(tmp_path)


class Unsaveable:
    def __reduce__(self):
        raise RuntimeError("cannot be saved")


def test_failed_save_leaves_nothing_behind(tmp_path):
    m = model()
    shards = to_megatron(m.state_dict(), m.config, tp=2)
    shards[(1, 0)]["unsaveable"] = Unsaveable()  # the second of two rank files fails
    with pytest.raises(RuntimeError, match="cannot be saved"):
        save_megatron_checkpoint(shards, tmp_path / "c", checkpoint_args(m.config, tp=2, pp=1))
    assert list(tmp_path.iterdir()) == []


def test_command_line_round_trip_without_megatron(tmp_path, monkeypatch, capsys):
    """Both commands with megatron unimportable (the converter needs torch only); the saved args describe the model,
    so a checkpoint is refused for a config it was not made from; --overwrite replaces an earlier conversion."""
    monkeypatch.setitem(sys.modules, "megatron", None)  # any import of megatron now raises ImportError
    m = model("qwen")
    m.save_pretrained(tmp_path / "hf")
    tiny_gpt_config(**CONFIGS["qwen"], num_hidden_layers=2).save_pretrained(tmp_path / "other")
    d = str(tmp_path)
    main(["to-megatron", d + "/hf", d + "/mlm", "--tp", "2", "--pp", "2"])
    main(["to-megatron", d + "/hf", d + "/mlm", "--tp", "2", "--overwrite"])
    assert sorted(p.name for p in (tmp_path / "mlm/release").iterdir()) == ["mp_rank_00_000", "mp_rank_01_001"]
    main(["to-hf", d + "/mlm", d + "/back", "--config", d + "/hf"])
    assert_same(GPTMoEForCausalLM.from_pretrained(d + "/back").state_dict(), m.state_dict())
    with pytest.raises(SystemExit) as exit:  # a refusal is one line on stderr and exit code 2, no traceback
        main(["to-hf", d + "/mlm", d + "/bad", "--config", d + "/other"])
    assert exit.value.code == 2
    assert "saved for another model: num_layers=4" in capsys.readouterr().err
