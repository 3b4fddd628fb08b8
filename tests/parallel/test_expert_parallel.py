"""TP + PPMoE expert parallelism on 2 processes (gloo) against the single-process model; every test body runs on both
ranks (tests/distributed.py)."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from distributed import tmp_dir
from equivalence import (
    ATOL,
    GATES,
    LLAMA,
    QWEN3,
    SEQ2SEQ_GATES,
    batch,
    build,
    collectives_of,
    experts,
    gates,
    lm_step,
    max_diff,
    replicated_spread,
    save_checkpoint,
    train_pair,
)
from helpers import GPT2_STYLE

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.parallel import count_collectives, make_mesh, parallelize

pytestmark = pytest.mark.distributed(2)


def assert_steps_match(steps):
    for i, step in enumerate(steps):
        assert step["loss"] == pytest.approx(step["ref_loss"], abs=1e-5), f"step {i}"
        assert step["grad"] < ATOL, f"step {i}: gradients differ by {step['grad']}"


@pytest.mark.parametrize("gate", [f"gpt/{g}" for g in GATES] + [f"seq2seq/{g}" for g in SEQ2SEQ_GATES])
def test_tp_ep_equals_single_process_for_every_gate(gate):
    """parallelize() (TP + PPMoE EP over 2 ranks) = single process, for every gate, through two optimizer steps."""
    family, name = gate.split("/")
    kind = {"seq2seq": True} if family == "seq2seq" else {}
    settings = (SEQ2SEQ_GATES if kind else GATES)[name]
    ref = build(**kind, **settings)
    model = parallelize(build(**kind, **settings), dist.group.WORLD)
    assert_steps_match(train_pair(model, ref))
    assert max_diff(model, ref, what="param") < ATOL  # after two optimizer steps
    assert replicated_spread([gate.weight for gate in gates(model)]) == 0.0  # replicated routers stay bitwise equal
    assert {e.num_experts for e in experts(model)} == {2}
    assert {str(e.down_proj.placements) for e in experts(model)} == {"(Shard(dim=0),)"}


def router_gradient_all_reduces(model, seq2seq=False):
    """All-reduces of the router weight's size [E, H] in one training step's backward: none under PPMoE (its dispatch
    sums the routing weights' gradients, so every rank's router gradient is whole: hf_ppmoe/parallel/expert_parallel.py)
    nor under Transformers' own all-reduce EP."""
    E, H = model.config.num_experts, model.config.hidden_size
    with count_collectives() as comm:
        ids, mask, labels = batch(seq2seq=seq2seq)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    model.zero_grad()
    return sum(1 for c in comm.calls if c.op == "all_reduce" and c.bytes == E * H * 4)


TRANSFORMERS_WAYS = [
    "gpt/maybe_distribute_model_ep_ppmoe",
    "gpt/from_pretrained_ep_ppmoe",
    "gpt/from_pretrained_tp",
    "gpt/from_pretrained_tp_plan_auto",
    "gpt/transformers_all_reduce_ep",
    "seq2seq/maybe_distribute_model_ep_ppmoe",
    "seq2seq/from_pretrained_ep_ppmoe",
    "seq2seq/from_pretrained_tp_plan_auto",
]


@pytest.mark.parametrize("way", TRANSFORMERS_WAYS)
def test_transformers_entry_points(way):
    """The same split through Transformers: DistributedConfig(tp_size=2, ep_size=2, ep_implementation="ppmoe") on a
    built model and in from_pretrained, from_pretrained(distributed_config=DistributedConfig(tp_size=2)) (PPMoE from
    the tensor-parallel plan), from_pretrained(tp_plan="auto"), and Transformers' own all-reduce EP on our model."""
    from transformers import DistributedConfig

    family, name = way.split("/")
    seq2seq = family == "seq2seq"
    cls = Seq2SeqMoEForConditionalGeneration if seq2seq else GPTMoEForCausalLM
    settings = SEQ2SEQ_GATES["switch_jitter_capacity"] if seq2seq else GATES["gshard_random_capacity"]
    config = {
        "maybe_distribute_model_ep_ppmoe": DistributedConfig(tp_size=2, ep_size=2, ep_implementation="ppmoe"),
        "from_pretrained_ep_ppmoe": DistributedConfig(tp_size=2, ep_size=2, ep_implementation="ppmoe"),
        "from_pretrained_tp": DistributedConfig(tp_size=2),
        "from_pretrained_tp_plan_auto": "auto",
        "transformers_all_reduce_ep": DistributedConfig(tp_size=2, ep_size=2, ep_implementation="all_reduce"),
    }[name]
    path = tmp_dir() / "checkpoint"
    save_checkpoint(settings, path, seq2seq)
    generators = [gate.generator.get_state() for gate in gates(build(seq2seq=seq2seq, **settings))]

    def reseed(model):  # a loaded model has no router generators: give it the reference's
        for gate, state in zip(gates(model), generators):
            gate.generator = torch.Generator()
            gate.generator.set_state(state)
        return model.train()

    if name.startswith("from_pretrained"):
        keyword = {"tp_plan": config} if config == "auto" else {"distributed_config": config}
        model = reseed(cls.from_pretrained(path, **keyword))
    else:
        config, _, mesh_manager = cls.prepare_distribute_model(config)
        model = cls.maybe_distribute_model(build(seq2seq=seq2seq, **settings), config, mesh_manager)
    ref = reseed(build(seq2seq=seq2seq, **settings))
    assert_steps_match(train_pair(model.train(), ref, steps=1))
    assert {e.num_experts for e in experts(model)} == {2}
    assert router_gradient_all_reduces(model, seq2seq) == 0  # routers whole on every rank, no sum of their own
    assert replicated_spread([gate.weight for gate in gates(model)]) == 0.0


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_ppmoe_expert_parallelism_on_transformers_qwen3_moe(norm_topk_prob):
    """Our registered "ppmoe" EP on a Transformers-native MoE (router outside the experts, no "ppmoe_ffn" layer):
    the experts sum over the ranks themselves, so loss, gradients and parameters equal one process."""
    from transformers import DistributedConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, output_router_logits=True, router_aux_loss_coef=0.1, pad_token_id=0,
    )
    path = tmp_dir() / "qwen3_moe"
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(config).save_pretrained(path)
    dist.barrier()
    ep = DistributedConfig(tp_size=2, ep_size=2, ep_implementation="ppmoe")
    model = Qwen3MoeForCausalLM.from_pretrained(path, distributed_config=ep).train()
    ref = Qwen3MoeForCausalLM.from_pretrained(path).train()
    assert_steps_match(train_pair(model, ref))
    assert max_diff(model, ref, what="param") < ATOL
    assert {e.num_experts for e in experts(model)} == {2}


T, S, H, E, HEAD_DIM, BYTES = 2 * 8, 2 * 12, 32, 4, 8, 4  # tokens, encoder tokens, hidden, experts, bytes per element


def gpt_layer_collectives(style):
    """Collectives of a dense layer's attention and FFN and of an MoE layer's FFN (layers 0 and 1)."""
    model = parallelize(build(moe_layer_frequency=2, **style), dist.group.WORLD)
    dense, moe = model.model.layers[0], model.model.layers[1]
    x = torch.randn(2, 8, H, requires_grad=True)
    rotary = model.config.position_embedding_type != "learned"
    positions = model.model.rotary_emb(x, torch.arange(8)[None]) if rotary else None
    return {
        "attention": collectives_of(lambda: dense.self_attn(x, position_embeddings=positions, attention_mask=None)[0]),
        "dense_ffn": collectives_of(lambda: dense.mlp(x)),
        "moe_layer": collectives_of(lambda: moe.mlp(x)[0]),
    }


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_moe_layer_communicates_as_a_dense_ffn(style):
    """PPMoE's claim (Sec. 3.3.4): an MoE layer issues what a tensor-parallel dense FFN issues, one all-reduce of
    [T, H] forward and one backward, plus only the routing weights' gradient [T, K] (float32) in backward."""
    result = gpt_layer_collectives({"llama": LLAMA, "gpt2": GPT2_STYLE}[style])
    one_all_reduce = [["all_reduce", T * H * BYTES]]
    dense, moe = result["dense_ffn"], result["moe_layer"]
    assert dense["forward"] == dense["backward"] == one_all_reduce
    assert result["attention"]["forward"] == result["attention"]["backward"] == one_all_reduce
    assert moe["forward"] == dense["forward"]
    K = 2  # tiny_gpt_config's top-k
    assert sorted(moe["backward"]) == sorted(dense["backward"] + [["all_reduce", T * K * 4]])


def test_qwen3_attention_sums_only_its_per_head_norm_gradients():
    """Qwen3's q/k norms normalise this rank's heads with replicated weights: the attention communicates as Llama's
    plus one all-reduce of each norm's [head_dim] gradient in backward (gradients equal: tp_ep_every_gate, gshard)."""
    attention = gpt_layer_collectives(QWEN3)["attention"]
    assert attention["forward"] == [["all_reduce", T * H * BYTES]]
    expected = [["all_reduce", T * H * BYTES], ["all_reduce", HEAD_DIM * BYTES], ["all_reduce", HEAD_DIM * BYTES]]
    assert sorted(attention["backward"]) == sorted(expected)


def test_encoder_decoder_attention_communicates_as_megatron():
    """Heads split with the relative position bias looked up per rank (no communication of its own): self-attention
    issues one all-reduce of [T, H] each way; cross-attention adds one for the encoder output's gradient [S, H]."""
    model = parallelize(build(seq2seq=True), dist.group.WORLD)
    decoder = model.model.decoder
    x, encoder_out = torch.randn(2, 8, H, requires_grad=True), torch.randn(2, 12, H, requires_grad=True)
    self_attention = collectives_of(
        lambda: decoder.layers[0].self_attn(
            x, attention_mask=None, position_bias=decoder.position_bias(8, 8, 0, x.device)
        )[0]
    )
    cross_attention = collectives_of(
        lambda: decoder.layers[0].cross_attn(x, attention_mask=None, key_value_states=encoder_out)[0]
    )
    assert self_attention["forward"] == self_attention["backward"] == [["all_reduce", T * H * BYTES]]
    assert cross_attention["forward"] == [["all_reduce", T * H * BYTES]]
    expected = [["all_reduce", T * H * BYTES], ["all_reduce", S * H * BYTES]]
    assert sorted(cross_attention["backward"]) == sorted(expected)


def test_clear_errors():
    with pytest.raises(ValueError, match="num_experts=3") as experts_error:
        parallelize(build(num_experts=3, num_experts_per_tok=2), dist.group.WORLD)
    assert "2 ranks" in str(experts_error.value)
    with pytest.raises(ValueError, match="pp=1 x tp=3") as mesh_error:
        make_mesh(pp=1, tp=3)
    assert "has 2" in str(mesh_error.value)


@pytest.mark.parametrize("family", ["gpt", "seq2seq"])
def test_save_pretrained_after_parallelize(family):
    """Every rank calls save_pretrained on the split model; rank 0 writes it whole, and it loads in one process."""
    seq2seq = family == "seq2seq"
    cls = Seq2SeqMoEForConditionalGeneration if seq2seq else GPTMoEForCausalLM
    settings = (SEQ2SEQ_GATES if seq2seq else GATES)["topk_dropless_einsum"]  # the encoder-decoder's head is tied
    path = tmp_dir() / "saved"
    model = parallelize(build(seq2seq=seq2seq, **settings), dist.group.WORLD)
    lm_step(model, *batch(seq2seq=seq2seq))  # one step first: the saved weights are not the initial ones
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    model.save_pretrained(path)
    dist.barrier()
    loaded = cls.from_pretrained(path)
    assert max_diff(model, loaded, what="param") == 0.0
    assert "model.safetensors" in os.listdir(path)


def test_hung_rank_times_out():
    """Rank 1 stays alive but skips a collective: rank 0's all-reduce fails after the group's timeout."""
    group = make_mesh(tp=2, timeout=timedelta(seconds=2))["tp"].get_group()
    x = torch.ones(2)
    dist.all_reduce(x, group=group)  # the group works
    start = time.monotonic()
    if dist.get_rank() == 1:
        time.sleep(4)
        return
    with pytest.raises(RuntimeError, match="Timed out"):
        dist.all_reduce(x, group=group)
    assert 1.5 < time.monotonic() - start < 15


@pytest.mark.distributed(2, last=True)  # rank 1's process ends here: the last test of its launch
def test_dead_rank_fails_fast():
    """Rank 1 exits: rank 0's next collective fails at once, long before the group's timeout of 30 s."""
    group = make_mesh(tp=2, timeout=timedelta(seconds=30))["tp"].get_group()
    dist.barrier(group=group)
    if dist.get_rank() == 1:
        raise SystemExit
    time.sleep(1)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="peer"):  # "Connection closed by peer" / "reset by peer"
        dist.all_reduce(torch.ones(2), group=group)
    assert time.monotonic() - start < 10
