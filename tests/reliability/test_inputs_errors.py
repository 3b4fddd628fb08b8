"""Bad inputs get an error that names the problem (or, where the result is still defined, a warning): empty batches
and sequences, token ids outside the vocabulary, positions beyond a learned position table (forward, generate, flat
beam search), flat beam search without a prompt, labels with no target, `merge --method usage` without texts, a
recorded expert_output_scale of 0, and a Megatron checkpoint with a garbage tracker or a truncated rank file."""

import json
import warnings

import pytest
import torch
from helpers import GPT2_STYLE, tiny_gpt_config, tiny_seq2seq_config

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe_cli import main as cli
from hf_ppmoe.conversion import merge_experts, upcycle
from hf_ppmoe.megatron.weights import ConversionError, checkpoint_args, load_megatron_checkpoint, save_megatron_checkpoint, to_megatron
from hf_ppmoe.generation import flat_beam_search


@pytest.fixture(scope="module")
def gpt():
    return GPTMoEForCausalLM(tiny_gpt_config(**GPT2_STYLE)).eval()  # learned positions: 64 of them


@pytest.fixture(scope="module")
def seq2seq():
    return Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config()).eval()


def test_inputs_empty_batch_or_sequence(gpt, seq2seq):
    ids = torch.randint(3, 97, (2, 4))
    for shape in [(0, 4), (2, 0)]:
        empty = torch.zeros(shape, dtype=torch.long)
        with pytest.raises(ValueError, match=rf"input_ids has shape \({shape[0]}, {shape[1]}\): .* at least one token"):
            gpt(empty)
        with pytest.raises(ValueError, match=r"^input_ids has shape"):
            seq2seq(empty, decoder_input_ids=ids)
    with pytest.raises(ValueError, match=r"decoder input_ids has shape \(2, 0\)"):
        seq2seq(ids, labels=ids[:, :0])
    with pytest.raises(ValueError, match=r"inputs_embeds has shape \(2, 0, 32\)"):
        gpt(inputs_embeds=torch.zeros(2, 0, 32))


@pytest.mark.parametrize("bad", [97, 500, -1])
def test_inputs_token_ids_outside_the_vocabulary(gpt, seq2seq, bad):
    ids = torch.randint(3, 97, (2, 4))
    ids[1, 2] = bad
    with pytest.raises(ValueError, match=rf"Token ids must lie in \[0, 97\); got {bad} at index \[1, 2\]"):
        gpt(ids)
    with pytest.raises(ValueError, match=rf"Token ids must lie in \[0, 97\); got {bad}"):
        seq2seq(ids, decoder_input_ids=ids[:, :2])
    with pytest.raises(ValueError, match=rf"Decoder token ids must lie in \[0, 97\); got {bad}"):
        seq2seq(ids.clamp(0, 96), decoder_input_ids=ids)


def test_inputs_beyond_learned_positions(gpt):
    with pytest.raises(ValueError, match=r"reaches position 64\. Learned positions end at max_position_embeddings=64"):
        gpt(torch.randint(3, 97, (1, 65)))
    with pytest.raises(ValueError, match=r"Position ids must lie in \[0, 64\); got 70"):
        gpt(torch.randint(3, 97, (1, 2)), position_ids=torch.tensor([[10, 70]]))
    prompt = torch.randint(3, 97, (1, 60))
    with pytest.raises(ValueError, match="max_position_embeddings=64"):  # greedy decoding runs past the table
        gpt.generate(prompt, max_new_tokens=8, do_sample=False)
    with pytest.raises(ValueError, match=r"flat_beam_search: the hypotheses would reach position 67, .* learned "
                                         r"positions end at max_position_embeddings=64"):
        gpt.generate(prompt, max_new_tokens=8, num_beams=2, custom_generate=flat_beam_search)
    gpt.generate(prompt, max_new_tokens=4, num_beams=2, custom_generate=flat_beam_search)  # up to position 63: fine


def test_inputs_flat_beam_search_needs_a_prompt(gpt):
    with pytest.raises(ValueError, match="flat_beam_search: needs a prompt of at least one token"):
        gpt.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2, num_beams=2, custom_generate=flat_beam_search)


def test_inputs_labels_without_targets_warn(gpt, seq2seq):
    ids = torch.randint(3, 97, (2, 4))
    cases = [
        (gpt, dict(input_ids=ids, labels=torch.full_like(ids, -100))),
        (gpt, dict(input_ids=ids[:, :1], labels=ids[:, :1])),  # one token: nothing to predict it from
        (seq2seq, dict(input_ids=ids, decoder_input_ids=ids, labels=torch.full_like(ids, -100))),
    ]
    for model, inputs in cases:
        with pytest.warns(UserWarning, match="No label in this batch is a target"):
            assert model(**inputs).loss == 0  # finite: it trains nothing (tests/modeling/test_no_target_batches.py)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an ordinary batch does not warn
        gpt(ids, labels=ids)
        seq2seq(ids, labels=ids)


@pytest.fixture(scope="module")
def upcycled(tmp_path_factory):
    """A GPT-2 upcycled to GPT-MoE, saved without a tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    dense = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    return upcycle(dense, num_experts=2, save_directory=tmp_path_factory.mktemp("moe") / "moe")


def test_inputs_merge_usage_without_texts_says_so_before_loading(upcycled, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:  # refused with the flags, before the model is read
        cli(["merge", str(upcycled), str(tmp_path / "dense"), "--method", "usage"])
    error = capsys.readouterr().err
    assert exit.value.code == 2 and "--method usage needs --sample_file" in error, error
    assert not (tmp_path / "dense").exists()


def test_inputs_recorded_expert_output_scale_of_zero(upcycled, tmp_path):
    config = json.loads((upcycled / "config.json").read_text())
    config["conversion"]["expert_output_scale"] = 0
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    for item in upcycled.iterdir():
        if item.is_file():
            (hostile / item.name).write_bytes(item.read_bytes())
    (hostile / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"config.conversion.expert_output_scale=0: it must be a positive finite"):
        merge_experts(hostile, save_directory=tmp_path / "dense")


def test_inputs_megatron_garbage_tracker_and_truncated_rank_file(tmp_path):
    model = GPTMoEForCausalLM(tiny_gpt_config())
    root = save_megatron_checkpoint(
        to_megatron(model.state_dict(), model.config, tp=2, pp=1), tmp_path / "megatron", checkpoint_args(model.config, tp=2, pp=1)
    )
    tracker = root / "latest_checkpointed_iteration.txt"
    tracker.write_bytes(b"\x00\x13garbage")
    with pytest.raises(ConversionError, match=r"latest_checkpointed_iteration.txt holds .*garbage.*'release' or the iteration"):
        load_megatron_checkpoint(root)
    tracker.write_text("release")
    rank_file = root / "release" / "mp_rank_01_001" / "model_optim_rng.pt"  # TP rank 1 (and expert rank 1)
    intact = rank_file.read_bytes()
    for cut in (1000, len(intact) // 2):  # torch.load fails differently (a zip error, an OSError) depending on where
        rank_file.write_bytes(intact[:cut])
        with pytest.raises(ConversionError, match=rf"{rank_file} cannot be read, the file is truncated or damaged"):
            load_megatron_checkpoint(root)
