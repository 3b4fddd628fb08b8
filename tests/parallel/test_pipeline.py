"""Pipeline parallelism (2 processes) and TP x PP (4 processes) against single-process gradient accumulation; every
test body runs on all ranks (tests/distributed.py)."""

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from distributed import tmp_dir
from equivalence import ATOL, LLAMA, QWEN3, SEQ2SEQ_PIPELINE, batch, build, run_pipeline, save_checkpoint
from helpers import GPT2_STYLE

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.modeling.stages import LayerOfAnotherStage, is_held
from hf_ppmoe.parallel import GPTMoEStage, Seq2SeqMoEStage, make_mesh, split_layers

STYLES = {"llama": LLAMA, "gpt2": GPT2_STYLE, "qwen3": QWEN3, "seq2seq": SEQ2SEQ_PIPELINE}


def assert_matches(result):
    for i, step in enumerate(result["steps"]):
        assert step["loss"] == pytest.approx(step["ref_loss"], abs=1e-5), f"step {i}"
        assert step["grad"] < ATOL, f"step {i}: gradients differ by {step['grad']}"
    assert result["params_after"] < ATOL


@pytest.mark.distributed(2)
@pytest.mark.parametrize(
    "case", ["gpipe/llama", "gpipe/gpt2", "gpipe/seq2seq", "1f1b/llama", "1f1b/gpt2", "1f1b/seq2seq"]
)
def test_two_stages_equal_single_process(case):
    """PP=2, GPipe and 1F1B: loss and gradients = single-process gradient accumulation, over two optimizer steps; the
    encoder-decoder split encoder | decoder (the encoder output alone crosses, the second stage starts the decoder)."""
    schedule, style = case.split("/")
    assert_matches(run_pipeline(schedule, STYLES[style], dist.group.WORLD, None))


@pytest.mark.distributed(4)
@pytest.mark.parametrize("case", ["gpipe/qwen3", "1f1b/gpt2", "1f1b/seq2seq"])
def test_tp_times_pp_equals_single_process(case):
    """TP=2 x PP=2 on a (pp, tp) mesh: loss and gradients = single-process accumulation (q/k norm gradients, partial
    per TP rank, summed per microbatch: accumulation must not sum them twice)."""
    schedule, style = case.split("/")
    mesh = make_mesh(pp=2, tp=2, timeout=timedelta(seconds=60))
    assert_matches(run_pipeline(schedule, STYLES[style], mesh["pp"], mesh["tp"]))


@pytest.mark.distributed(4)
def test_encoder_decoder_on_four_stages_equals_single_process():
    """[enc 0-1] -> [enc 2, dec 0] -> [dec 1] -> [dec 2, head]: every kind of hand-over, the encoder output passed
    through a stage, and parameters several stages hold (embeddings in both stacks and the tied head; each stack's
    relative position bias table) summed over exactly those stages."""
    result = run_pipeline("gpipe", SEQ2SEQ_PIPELINE, dist.group.WORLD, None, layers=3)
    assert_matches(result)
    assert result["holders"] == {
        "embeddings": [0, 1, 3],
        "encoder.relative_attention_bias": [0, 1],
        "decoder.relative_attention_bias": [1, 2, 3],
    }


def transformers_pipeline_pair(style):
    """A GPT-MoE checkpoint loaded with from_pretrained(distributed_config=DistributedConfig(pp_size=2)) and whole."""
    from transformers import DistributedConfig

    path = tmp_dir() / "checkpoint"
    save_checkpoint(dict(num_hidden_layers=4, moe_layer_frequency=2, **style), path)
    model = GPTMoEForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(pp_size=2))
    return model, GPTMoEForCausalLM.from_pretrained(path)


@pytest.mark.distributed(2)
@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_transformers_pipeline_parallelism_runs_gpt_moe(style):
    """from_pretrained(distributed_config=DistributedConfig(pp_size=2)): each rank runs its half of the layers;
    logits and greedy generation (left padding, KV cache) equal one process, learned positions added once."""
    model, ref = transformers_pipeline_pair(STYLES[style])
    ids, mask, _ = batch(size=3, length=7)
    mask[-1, -4:] = 1  # generation pads on the left only
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits - ref(input_ids=ids, attention_mask=mask).logits
    assert logits.abs().max().item() < 1e-6
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    layers_here = [i for i, layer in enumerate(model.model.layers) if hasattr(layer, "self_attn")]
    assert layers_here == [[0, 1], [2, 3]][dist.get_rank()]


@pytest.mark.distributed(2)
def test_transformers_pipeline_parallelism_refusals():
    """A training forward, refused on every stage before any communicates (the second would wait for activations),
    and an encoder-decoder."""
    from transformers import DistributedConfig

    model, _ = transformers_pipeline_pair(GPT2_STYLE)
    ids = batch(size=3, length=7)[0]
    with pytest.raises(RuntimeError, match="runs inference only") as error:
        model.train()(input_ids=ids, labels=ids)
    assert "hf_ppmoe.parallel.Pipeline" in str(error.value)
    path = tmp_dir() / "seq2seq"
    save_checkpoint({}, path, seq2seq=True)
    with pytest.raises(ValueError, match="Seq2SeqMoEForConditionalGeneration has an encoder and a decoder"):
        Seq2SeqMoEForConditionalGeneration.from_pretrained(path, distributed_config=DistributedConfig(pp_size=2))


def test_split_layers():
    assert split_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    with pytest.raises(ValueError, match="at least as many layers"):
        split_layers(2, 3)


@pytest.mark.parametrize("seq2seq", [False, True], ids=["gpt", "seq2seq"])
def test_a_stage_keeps_the_whole_models_names_and_no_forward_of_its_own(seq2seq):
    """Issue 30: a stage is the model itself, cut by `hf_ppmoe.modeling.stages` (the cut Transformers' pp_size path gets
    too): its parameters are the whole model's under the same names (no renaming when gathering), and the layers of
    other stages are pass-through stand-ins at their index."""
    whole = build(seq2seq=seq2seq, num_hidden_layers=4, **({"num_decoder_layers": 2} if seq2seq else {}))
    cut = build(seq2seq=seq2seq, num_hidden_layers=4, **({"num_decoder_layers": 2} if seq2seq else {}))
    stage_class = Seq2SeqMoEStage if seq2seq else GPTMoEStage
    stage = stage_class(cut, range(2, 4), is_first=False, is_last=False, num_microbatches=1)
    params, reference = dict(stage.model.named_parameters()), dict(whole.named_parameters())
    prefix = "model.encoder.layers" if seq2seq else "model.layers"
    assert {n[len(prefix) + 1 :].split(".")[0] for n in params if n.startswith(prefix + ".")} == {"2", "3"}
    assert all(torch.equal(p, reference[n]) for n, p in params.items())
    layers = stage.model.model.encoder.layers if seq2seq else stage.model.model.layers
    assert [is_held(layer) for layer in layers] == [False, False, True, True]
    assert all(isinstance(layers[i], LayerOfAnotherStage) for i in (0, 1))


@pytest.mark.parametrize("seq2seq", [False, True], ids=["gpt", "seq2seq"])
def test_stages_run_in_turn_equal_the_whole_model_with_dropout(seq2seq):
    """A stage runs the stacks' own forwards over what it holds (`cut_stack`): the stages of one model, run one after
    the other in one process, give the whole model's logits with dropout active, so each stack's embedding, input
    dropout, final norm and output dropout run once, where the stack starts and ends (the same random draws in the
    same order). Seq2seq: [enc 0-1] -> [enc 2, dec 0] -> [dec 1-2]; GPT: learned positions, [0] -> [1] -> [2]."""
    settings = dict(hidden_dropout=0.3, num_hidden_layers=3, moe_layer_frequency=1)
    settings.update({"num_decoder_layers": 3} if seq2seq else GPT2_STYLE)
    whole, cut = build(seq2seq=seq2seq, **settings), build(seq2seq=seq2seq, **settings)
    ids, mask, labels = batch(seq2seq=seq2seq)
    torch.manual_seed(7)
    expected = whole(input_ids=ids, attention_mask=mask, labels=labels).logits

    stage_class = Seq2SeqMoEStage if seq2seq else GPTMoEStage
    layers = split_layers(stage_class.num_layers(cut.config), 3)
    stages = [copy.deepcopy(cut) for _ in layers]
    stages = [stage_class(m, r, i == 0, i == len(layers) - 1, num_microbatches=1) for i, (m, r) in enumerate(zip(stages, layers))]
    args, kwargs, _ = stages[0].step_inputs(ids, labels, mask, None)
    torch.manual_seed(7)
    for stage in stages:
        out = stage(*args, **kwargs)
        args = out if isinstance(out, tuple) else (out,)
    (logits,) = args
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    torch.manual_seed(8)  # dropout is active: a different draw gives other logits
    assert not torch.allclose(whole(input_ids=ids, attention_mask=mask, labels=labels).logits, expected, atol=1e-3)
