"""Pipeline parallelism (2 processes) and TP x PP (4 processes) against single-process gradient accumulation."""

import pytest
from worker import ATOL

from hf_ppmoe.parallel import split_layers


def assert_matches(result):
    for i, step in enumerate(result["steps"]):
        assert step["loss"] == pytest.approx(step["ref_loss"], abs=1e-5), f"step {i}"
        assert step["grad"] < ATOL, f"step {i}: gradients differ by {step['grad']}"
    assert result["params_after"] < ATOL


@pytest.mark.parametrize(
    "case", ["gpipe/llama", "gpipe/gpt2", "gpipe/seq2seq", "1f1b/llama", "1f1b/gpt2", "1f1b/seq2seq"]
)
def test_two_stages_equal_single_process(two_ranks, case):
    for rank in two_ranks("pipeline_two_stages"):
        assert_matches(rank[case])


@pytest.mark.parametrize("case", ["gpipe/qwen3", "1f1b/gpt2", "1f1b/seq2seq"])
def test_tp_times_pp_equals_single_process(four_ranks, case):
    for rank in four_ranks("tp_times_pp"):
        assert_matches(rank[case])


def test_encoder_decoder_on_four_stages_equals_single_process(four_ranks):
    """[enc 0-1] -> [enc 2, dec 0] -> [dec 1] -> [dec 2, head]: every kind of hand-over, the encoder output passed
    through a stage, and parameters several stages hold (embeddings in both stacks and the tied head; each stack's
    relative position bias table) summed over exactly those stages."""
    for rank in four_ranks("seq2seq_four_stages"):
        assert_matches(rank["gpipe"])
        assert rank["gpipe"]["holders"] == {
            "embeddings": [0, 1, 3],
            "encoder.relative_attention_bias": [0, 1],
            "decoder.relative_attention_bias": [1, 2, 3],
        }


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_transformers_pipeline_parallelism_runs_gpt_moe(two_ranks, style):
    """from_pretrained(distributed_config=DistributedConfig(pp_size=2)): each rank runs its half of the layers;
    logits and greedy generation (left padding, KV cache) equal one process, learned positions added once."""
    for r, rank in enumerate(two_ranks("transformers_pipeline")):
        result = rank[style]
        assert result["layers_here"] == [[0, 1], [2, 3]][r]
        assert result["logits"] < 1e-6
        assert result["generate_equal"]


def test_transformers_pipeline_parallelism_refusals(two_ranks):
    result = two_ranks("transformers_pipeline", rank=1)  # the second stage, which would wait for activations
    assert "runs inference only" in result["training"] and "hf_ppmoe.parallel.Pipeline" in result["training"]
    assert "Seq2SeqMoEForConditionalGeneration has an encoder and a decoder" in result["seq2seq"]


def test_split_layers():
    assert split_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    with pytest.raises(ValueError, match="at least as many layers"):
        split_layers(2, 3)
