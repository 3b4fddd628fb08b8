"""TP + PPMoE expert parallelism on 2 processes (gloo) against the single-process model; see worker.py."""

import pytest
from worker import ATOL, GATES, SEQ2SEQ_GATES


def assert_steps_match(steps):
    for i, step in enumerate(steps):
        assert step["loss"] == pytest.approx(step["ref_loss"], abs=1e-5), f"step {i}"
        assert step["grad"] < ATOL, f"step {i}: gradients differ by {step['grad']}"


@pytest.mark.parametrize("gate", [f"gpt/{g}" for g in GATES] + [f"seq2seq/{g}" for g in SEQ2SEQ_GATES])
def test_tp_ep_equals_single_process_for_every_gate(two_ranks, gate):
    for rank in two_ranks("tp_ep_every_gate"):
        result = rank[gate]
        assert_steps_match(result["steps"])
        assert result["params_after"] < ATOL  # after two optimizer steps
        assert result["gate_spread"] == 0.0  # replicated router weights stay bitwise equal on both ranks
        assert result["local_experts"] == [2] and result["expert_placement"] == ["(Shard(dim=0),)"]


@pytest.mark.parametrize(
    "way",
    [
        "gpt/maybe_distribute_model_ep_ppmoe",
        "gpt/from_pretrained_ep_ppmoe",
        "gpt/from_pretrained_tp",
        "gpt/from_pretrained_tp_plan_auto",
        "gpt/transformers_all_reduce_ep",
        "seq2seq/maybe_distribute_model_ep_ppmoe",
        "seq2seq/from_pretrained_ep_ppmoe",
        "seq2seq/from_pretrained_tp_plan_auto",
    ],
)
def test_transformers_entry_points(two_ranks, way):
    for rank in two_ranks("transformers_entry_points"):
        result = rank[way]
        assert_steps_match(result["steps"])
        assert result["local_experts"] == [2]
        assert result["ppmoe"] == (way != "gpt/transformers_all_reduce_ep")


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_ppmoe_expert_parallelism_on_transformers_qwen3_moe(two_ranks, norm_topk_prob):
    """Our registered "ppmoe" EP on a Transformers-native MoE (router outside the experts, no "ppmoe_ffn" layer):
    the experts sum over the ranks themselves, so loss, gradients and parameters equal one process."""
    for rank in two_ranks("ppmoe_on_transformers_moe"):
        result = rank[f"norm_topk_prob={norm_topk_prob}"]
        assert_steps_match(result["steps"])
        assert result["params_after"] < ATOL
        assert result["local_experts"] == [2]


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_moe_layer_communicates_as_a_dense_ffn(two_ranks, style):
    """PPMoE's claim (Sec. 3.3.4): an MoE layer issues what a tensor-parallel dense FFN issues, one all-reduce of
    [T, H] forward and one backward, plus only the router weight gradient [E, H]."""
    result = two_ranks("communication_per_layer", rank=0)
    T, H, E, b = (result["sizes"][k] for k in ("T", "H", "E", "bytes_per_element"))
    one_all_reduce = [["all_reduce", T * H * b]]
    dense, moe = result[f"{style}/dense_ffn"], result[f"{style}/moe_layer"]
    assert dense["forward"] == dense["backward"] == one_all_reduce
    assert result[f"{style}/attention"]["forward"] == result[f"{style}/attention"]["backward"] == one_all_reduce
    assert moe["forward"] == dense["forward"]
    assert sorted(moe["backward"]) == sorted(dense["backward"] + [["all_reduce", E * H * b]])


def test_qwen3_attention_sums_only_its_per_head_norm_gradients(two_ranks):
    """Qwen3's q/k norms normalise this rank's heads with replicated weights: the attention communicates as Llama's
    plus one all-reduce of each norm's [head_dim] gradient in backward (gradients equal: tp_ep_every_gate, gshard)."""
    result = two_ranks("communication_per_layer", rank=0)
    T, H, D, b = (result["sizes"][k] for k in ("T", "H", "head_dim", "bytes_per_element"))
    attention = result["qwen3/attention"]
    assert attention["forward"] == [["all_reduce", T * H * b]]
    assert sorted(attention["backward"]) == sorted([["all_reduce", T * H * b], ["all_reduce", D * b], ["all_reduce", D * b]])


def test_encoder_decoder_attention_communicates_as_megatron(two_ranks):
    """Heads split with the relative position bias looked up per rank (no communication of its own): self-attention
    issues one all-reduce of [T, H] each way; cross-attention adds one for the encoder output's gradient [S, H]."""
    result = two_ranks("communication_per_layer", rank=0)
    T, S, H, b = (result["sizes"][k] for k in ("T", "S", "H", "bytes_per_element"))
    self_attention, cross_attention = result["seq2seq/self_attention"], result["seq2seq/cross_attention"]
    assert self_attention["forward"] == self_attention["backward"] == [["all_reduce", T * H * b]]
    assert cross_attention["forward"] == [["all_reduce", T * H * b]]
    assert sorted(cross_attention["backward"]) == sorted([["all_reduce", T * H * b], ["all_reduce", S * H * b]])


def test_clear_errors(two_ranks):
    result = two_ranks("errors", rank=0)
    assert "num_experts=3" in result["experts"] and "2 ranks" in result["experts"]
    assert "pp=1 x tp=3" in result["world_size"] and "has 2" in result["world_size"]


def test_hung_rank_times_out(two_ranks):
    result = two_ranks("hung_rank_times_out", rank=0)
    assert "Timed out" in result["error"]
    assert 1.5 < result["seconds"] < 15


def test_dead_rank_fails_fast(two_ranks):
    result = two_ranks("dead_rank_fails_fast", rank=0)
    assert "peer" in result["error"]  # "Connection closed by peer" / "reset by peer"
    assert result["seconds"] < 10  # the group's timeout is 30 s


@pytest.mark.parametrize("family", ["gpt", "seq2seq"])
def test_save_pretrained_after_parallelize(two_ranks, family):
    """Every rank calls save_pretrained on the split model; rank 0 writes it whole, and it loads in one process."""
    for rank in two_ranks("save_after_parallelize"):
        assert rank[family]["params"] == 0.0
        assert "model.safetensors" in rank[family]["files"]
