"""Seq2Seq-MoE through `python -m hf_ppmoe.training`: tensor parallel (PPMoE experts over --tp_size 2) and FSDP2
(--fsdp_size 2) equal one process (losses, gradient norms, saved model) and resume exactly, also after the whole job
is killed; pair data (columns, translation records, num_items_in_batch over any split); generation metrics."""

import json
import random
import signal

import pytest
import torch
from test_training import assert_same_run, launch, launch_and_kill, metrics, train_losses
from transformers import AutoModelForSeq2SeqLM, HfArgumentParser

from hf_ppmoe import Seq2SeqMoEConfig, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.training import TrainArguments, main
from hf_ppmoe.training.data import train_tokenizer
from hf_ppmoe.training.pairs import PairData, collate, read_pairs, tokenize_pairs
from hf_ppmoe.training.tracking import read_jsonl

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega return value list index key".split()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """80 (source, target) pairs, long enough that every one is cut to the same token lengths (12 / 8): the batches
    of one process and of two hold the same tokens in the same places, as packed blocks do for GPT-MoE; and tiny
    Seq2Seq-MoE configs (GShard gate with capacity) with 1 and 2 router groups, and a tokenizer fitted once (every
    run reads the same one)."""
    root, rng = tmp_path_factory.mktemp("pairs"), random.Random(0)
    rows = []
    for i in range(80):
        source = f"def f{i}(" + ", ".join(rng.choices(WORDS, k=12)) + "): return " + " + ".join(rng.choices(WORDS, k=12))
        rows.append({"code": source, "doc": "Compute the " + " ".join(rng.choices(WORDS, k=14)) + "."})
    (root / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    train_tokenizer([text for row in rows for text in row.values()], vocab_size=300).save_pretrained(root / "tokenizer")
    for groups in (1, 2):
        Seq2SeqMoEConfig(
            vocab_size=2048, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, num_experts=4, num_experts_per_tok=2,
            moe_layer_frequency=1, router_type="gshard", capacity_factor=1.5, router_random_routing=False,
            router_num_groups=groups,
        ).to_json_file(root / f"config_g{groups}.json")
    return root


def flags(root, out, steps=4, groups=1, **extra):
    values = dict(
        train_file=str(root / "pairs.jsonl"), source_column="code", target_column="doc",
        config_name=str(root / f"config_g{groups}.json"), tokenizer_name=str(root / "tokenizer"), output_dir=str(out), max_steps=steps,
        per_device_train_batch_size=8, max_source_length=12, max_target_length=8, eval_steps=2, eval_batches=1,
        generation_eval_pairs=4, generation_num_beams=2, learning_rate=3e-3, warmup_steps=1, plots=False,
        max_grad_norm=0.5, adam_epsilon=1e-4,
    )
    values.update(extra)
    return [f"--{k}={v}" for k, v in values.items()]


def one_process(root, out, **extra):
    return main(HfArgumentParser(TrainArguments).parse_args_into_dataclasses(flags(root, out, **extra))[0])


@pytest.fixture(scope="module")
def runs(pairs, tmp_path_factory):
    """References in this process: 8 pairs per step, router groups 1 (as tensor parallel: one replica) and 2 (as two
    data-parallel processes of 4). Two processes: a --fsdp_size 2 job (checkpoints every step) SIGKILLed after it
    logged step 2; then one launch of --tp_size 2 (checkpoints every 2 steps), --tp_size 2 resumed from step 2,
    --fsdp_size 2, and the killed job resumed with --resume latest."""
    root = tmp_path_factory.mktemp("seq2seq_runs")
    one_process(pairs, root / "reference", steps=4, checkpointing_steps=2)
    one_process(pairs, root / "reference_g2", steps=3, groups=2)
    fsdp = dict(steps=3, per_device_train_batch_size=4, fsdp_size=2)  # each process: one group of its 4 pairs
    killed = flags(pairs, root / "fsdp_killed", checkpointing_steps=1, **fsdp)
    status = launch_and_kill(2, killed, stop_step=2, log_dir=root)
    (root / "killed_status.json").write_text(json.dumps({"status": status, "logged": sorted(train_losses(root / "fsdp_killed"))}))
    launch(
        2,
        flags(pairs, root / "tp", steps=4, checkpointing_steps=2, tp_size=2),
        flags(pairs, root / "tp_resumed", steps=4, tp_size=2, resume=root / "tp" / "checkpoints" / "step_2"),
        flags(pairs, root / "fsdp", **fsdp),
        [*killed, "--resume=latest"],
    )
    return root


def assert_same_model(a, b):
    ours, theirs = (AutoModelForSeq2SeqLM.from_pretrained(path) for path in (a, b))
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)


def test_tensor_parallel_equals_one_process_and_resumes(runs):
    """--tp_size 2: attention heads and PPMoE experts split over the 2 processes; losses, router losses, gradient
    norms, evaluation and generation metrics and the saved model equal one process's; resumed from its step-2
    checkpoint it continues as the uninterrupted run."""
    assert set(train_losses(runs / "tp")) == {1, 2, 3, 4}
    assert_same_run(runs / "reference", runs / "tp", steps=[1, 2, 3, 4])
    assert_same_model(runs / "tp", runs / "reference")
    for key in ("eval/loss", "eval/chrf", "eval/bleu"):
        assert metrics(runs / "tp", key)[4] == pytest.approx(metrics(runs / "reference", key)[4], abs=1e-4), key
    assert set(train_losses(runs / "tp_resumed")) == {3, 4}
    assert_same_run(runs / "reference", runs / "tp_resumed", steps=[3, 4])
    assert_same_model(runs / "tp_resumed", runs / "reference")


def test_fsdp_equals_one_process_and_a_killed_job_resumes_exactly(runs):
    """--fsdp_size 2 (2 x 4 pairs, parameters, gradients and AdamW state sharded) == 1 process x 8 pairs with the
    router losses over 2 groups; the job SIGKILLed after step 2 resumes from its step-1 checkpoint and ends as the
    uninterrupted run, each step logged once."""
    assert min(metrics(runs / "fsdp", "train/grad_norm").values()) > 0  # a real gradient
    assert_same_run(runs / "reference_g2", runs / "fsdp", steps=[1, 2, 3])
    assert_same_model(runs / "fsdp", runs / "reference_g2")
    killed = json.loads((runs / "killed_status.json").read_text())
    assert killed["status"] == -signal.SIGKILL and killed["logged"] == [1, 2]
    assert [r["step"] for r in read_jsonl(runs / "fsdp_killed" / "logs" / "metrics.jsonl") if "train/lm_loss" in r] == [1, 2, 3]
    assert_same_run(runs / "fsdp", runs / "fsdp_killed", steps=[2, 3])
    assert_same_model(runs / "fsdp_killed", runs / "fsdp")


def test_outputs_of_a_seq2seq_run(runs):
    """Evaluation loss, perplexity, chrF and BLEU in the metrics file and the card; generated samples written."""
    last = [r for r in read_jsonl(runs / "reference" / "logs" / "metrics.jsonl") if "eval/chrf" in r][-1]
    assert last["step"] == 4 and 0 <= last["eval/chrf"] <= 100 and 0 <= last["eval/bleu"] <= 100
    samples = read_jsonl(runs / "reference" / "logs" / "samples.jsonl")
    assert len(samples) == 4 and {"source", "target", "generated"} <= set(samples[0])
    card = (runs / "reference" / "README.md").read_text()
    assert "text2text-generation" in card and "chrf" in card


def test_any_split_of_a_step_trains_the_same(pairs):
    """Pairs of different lengths: one process with 8 pairs and two with 4 each (and 2 micro-steps of 2 each) give the
    same loss and gradients, because every batch carries the step's label-token count (num_items_in_batch)."""
    data = read_pairs([str(pairs / "pairs.jsonl")], source_column="code", target_column="doc")
    tokenizer = train_tokenizer([*data["source"], *data["target"]], vocab_size=300)
    tokens = tokenize_pairs(data, tokenizer, 200, 100)
    assert len({len(labels) for labels in tokens["labels"]}) > 1  # lengths differ
    torch.manual_seed(0)
    model = Seq2SeqMoEForConditionalGeneration(Seq2SeqMoEConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_experts=4, router_aux_loss_coef=0.0, router_z_loss_coef=0.0))  # router losses are per forward (groups)

    def gradient(world, batch_size, accumulation):
        args = TrainArguments(per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation, seed=3)
        model.zero_grad()
        for rank in range(world):
            data = PairData(tokens, tokens, args, tokenizer.pad_token_id, rank, world)
            for micro in range(accumulation):
                loss = model(**data.batch(step=1, micro=micro)).loss
                (loss / (world * accumulation)).backward()  # what accumulation and data-parallel averaging do
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    reference = gradient(1, 8, 1)
    # what the run prints as `data: ...` (issue 31: it was the object's address)
    described = str(PairData(tokens, tokens, TrainArguments(), tokenizer.pad_token_id))
    assert described.startswith(f"{len(tokens)} training pairs (source + target: ") and described.endswith(f"{len(tokens)} held out")
    torch.testing.assert_close(gradient(2, 4, 1), reference, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gradient(2, 2, 2), reference, atol=1e-6, rtol=1e-5)


def test_pairs_from_csv_parquet_and_translation_records(tmp_path):
    import datasets

    rows = [{"de": f"Satz {i}", "en": f"sentence {i}"} for i in range(3)]
    datasets.Dataset.from_list(rows).to_csv(tmp_path / "p.csv")
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "p.parquet")
    for name in ("p.csv", "p.parquet"):
        data = read_pairs([str(tmp_path / name)], source_column="de", target_column="en")
        assert data[1] == {"source": "Satz 1", "target": "sentence 1"}
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps({"translation": r}) for r in rows))
    data = read_pairs([str(tmp_path / "t.jsonl")], source_lang="en", target_lang="de")
    assert data[2] == {"source": "sentence 2", "target": "Satz 2"}
    with pytest.raises(ValueError, match=r"no \['fr'\]"):
        read_pairs([str(tmp_path / "t.jsonl")], source_lang="en", target_lang="fr")
    with pytest.raises(ValueError, match="no column 'source'.*--source_column"):
        read_pairs([str(tmp_path / "p.csv")])


def test_collate_pads_inputs_and_masks_labels():
    batch = collate([{"input_ids": [5, 6, 1], "labels": [7, 1]}, {"input_ids": [5, 1], "labels": [8, 9, 1]}], 0)
    assert batch["input_ids"].tolist() == [[5, 6, 1], [5, 1, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[7, 1, -100], [8, 9, 1]]


def test_pipeline_stages_are_refused_with_the_reason(pairs, tmp_path):
    with pytest.raises(ValueError, match="--pp_size 2: .*encoder-decoder.*--tp_size"):
        one_process(pairs, tmp_path / "pp", pp_size=2)
