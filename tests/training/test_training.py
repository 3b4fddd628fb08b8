"""`hf_ppmoe.training`: data parallel, tensor parallel, pipeline parallel, sharded data parallel (FSDP2, HSDP), expert
parallelism wider than the TP group and their combinations == one process, kill + resume == uninterrupted (also tensor,
pipeline and sharded data parallel), logs/plots, argument errors."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from hf_ppmoe import GPTMoEConfig
from hf_ppmoe.training import TrainArguments, main
from hf_ppmoe.training.data import builtin_corpus, pack, read_text_files
from hf_ppmoe.training.tracking import read_jsonl
from helpers import KILLED_AFTER_STEP_5

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
RUNS = Path(__file__).with_name("runs.py")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text file (a slice of the built-in corpus) and tiny GPT-MoE configs with 1, 2 and 4 router groups,
    with a separate head or one tied to the embeddings."""
    root = tmp_path_factory.mktemp("data")
    (root / "train.txt").write_text("\n\n".join(builtin_corpus()[:12]))
    for groups in (1, 2, 4):
        for tied in (False, True):
            GPTMoEConfig(
                vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, router_type="gshard",
                capacity_factor=1.5, router_random_routing=False, router_num_groups=groups, tie_word_embeddings=tied,
            ).to_json_file(root / f"config_g{groups}{'_tied' if tied else ''}.json")
    return root


def flags(corpus, out, steps=4, **extra):
    values = dict(
        train_file=str(corpus / "train.txt"), config_name=str(corpus / "config_g1.json"), output_dir=str(out),
        max_steps=steps, per_device_train_batch_size=8, block_size=32, eval_steps=2, eval_batches=2,
        learning_rate=3e-3, warmup_steps=1, plots=False,
        max_grad_norm=0.5,  # below these runs' gradient norms (0.58-0.65): every step is clipped by the global norm
        # Adam turns float noise on near-zero gradients into full +-lr steps; a larger epsilon keeps runs that
        # compute the same gradients in different orders (1 vs 2 processes) on the same trajectory
        adam_epsilon=1e-4,
    )
    values.update(extra)
    return [f"--{k}={v}" for k, v in values.items()]


def run_cli(argv, timeout=600):
    cmd = [sys.executable, "-m", "hf_ppmoe.training", *argv]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def launch(nprocs, *runs):
    """`runs` (lists of flags) one after the other in one torchrun launch of `nprocs` processes."""
    command = [*TORCHRUN, f"--nproc-per-node={nprocs}", str(RUNS), json.dumps(runs)]
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]


def launch_and_kill(nprocs, argv, stop_step, log_dir):
    """A torchrun job of one run whose rank 0 stops once it has logged step `stop_step` (runs.py): when that line is in
    the log, the whole job (torchrun and its workers) is SIGKILLed, so nothing gets to clean up or save. Returns the
    job's exit status."""
    env = {**ENV, "HF_PPMOE_TEST_STALL_AFTER_STEP": str(stop_step)}
    command = [*TORCHRUN, f"--nproc-per-node={nprocs}", str(RUNS), json.dumps([argv])]
    log = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("--output_dir=")), "logs", "metrics.jsonl")

    def logged():
        try:
            return any(r.get("step") == stop_step and "train/lm_loss" in r for r in read_jsonl(log))
        except (OSError, ValueError):  # not written yet, or a line being written
            return False

    with open(log_dir / "killed_job.log", "w") as output:
        job = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        try:
            while not logged():
                assert job.poll() is None, (log_dir / "killed_job.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "the job never logged the step to kill it after"
                time.sleep(0.5)
        finally:
            # torchrun and every worker (torchrun starts each worker in a session of its own, so not killpg)
            for process in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
                process.kill()
            job.wait()
    return job.returncode


def metrics(out, key="train/lm_loss"):
    return {r["step"]: r[key] for r in read_jsonl(Path(out) / "logs" / "metrics.jsonl") if key in r}


def train_losses(out):
    return metrics(out)


def assert_same_run(a, b, steps, extra=()):
    """The same losses, router losses and gradient norms per step (float noise of a different summation order)."""
    for key, tolerance in (("train/lm_loss", 1e-5), ("train/aux_loss", 1e-4), ("train/grad_norm", 1e-4), *extra):
        values_a, values_b = metrics(a, key), metrics(b, key)
        assert set(values_a) >= set(steps) and set(values_b) >= set(steps), key
        for step in steps:
            assert values_a[step] == pytest.approx(values_b[step], rel=tolerance, abs=tolerance), (key, step)


def assert_same_model(a, b):
    ours, theirs = (AutoModelForCausalLM.from_pretrained(path) for path in (a, b))
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)


def _args(corpus, out, **extra):
    """The same flags, parsed as the CLI parses them, for an in-process run."""
    return HfArgumentParser(TrainArguments).parse_args_into_dataclasses(flags(corpus, out, **extra))[0]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """One process, 8 sequences per step, 6 steps, checkpoints every 2."""
    out = tmp_path_factory.mktemp("reference")
    main(_args(corpus, out, max_steps=6, checkpointing_steps=2))
    return out


@pytest.fixture(scope="module")
def reference_two_groups(corpus, tmp_path_factory):
    """One process computing its router losses over 2 groups of 4 sequences, as 2 data-parallel replicas do."""
    out = tmp_path_factory.mktemp("reference_g2")
    main(_args(corpus, out, config_name=str(corpus / "config_g2.json"), max_steps=3))
    return out


@pytest.fixture(scope="module")
def reference_tied_two_groups(corpus, tmp_path_factory):
    """As reference_two_groups, with the head tied to the embeddings (a parameter both pipeline stages hold)."""
    out = tmp_path_factory.mktemp("reference_g2_tied")
    main(_args(corpus, out, config_name=str(corpus / "config_g2_tied.json"), max_steps=3))
    return out


@pytest.fixture(scope="module")
def reference_tied_four_groups(corpus, tmp_path_factory):
    """One process computing its router losses over 4 groups of 2 sequences (4 data-parallel processes of 2
    sequences, or 2 of 2 microbatches of 2), with the head tied to the embeddings."""
    out = tmp_path_factory.mktemp("reference_g4_tied")
    main(_args(corpus, out, config_name=str(corpus / "config_g4_tied.json"), max_steps=3))
    return out


# --pp_size 2 with 2 microbatches of 4 sequences: each microbatch computes its router losses on its own tokens, as
# one router group of a single process's 8 sequences (router_num_groups=2) does
PIPELINE = dict(steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2, pp_size=2)
# --fsdp_size 2 on 2 processes: 2 x 4 sequences, as data parallel
FSDP = dict(steps=3, per_device_train_batch_size=4, fsdp_size=2)


@pytest.fixture(scope="module")
def two_processes(corpus, tmp_path_factory):
    """A 2-process FSDP job (checkpoints every step) SIGKILLed after it logged step 2 (its step-2 checkpoint never
    finished), then one launch of 2 processes: data parallel (2 x 4 sequences), data parallel evaluating one batch
    (fewer than the replicas), tensor parallel (--tp_size 2, 8 sequences, with checkpoints), tensor parallel resumed
    from that run's step-4 checkpoint, pipeline parallel (--pp_size 2, tied head, with checkpoints), pipeline parallel
    resumed from its step-2 checkpoint, FSDP (--fsdp_size 2, evaluating one batch) and the killed FSDP run resumed
    with --resume latest."""
    root = tmp_path_factory.mktemp("two_processes")
    killed = flags(corpus, root / "fsdp_killed", checkpointing_steps=1, **FSDP)
    status = launch_and_kill(2, killed, stop_step=2, log_dir=root)
    (root / "killed_status.json").write_text(json.dumps({
        "status": status, "logged": sorted(train_losses(root / "fsdp_killed")),
        "model_written": (root / "fsdp_killed" / "model.safetensors").exists(),
        "checkpoints": sorted(p.name for p in (root / "fsdp_killed" / "checkpoints").iterdir()),
    }))
    tp_checkpoint = root / "tp" / "checkpoints" / "step_4"
    tied = str(corpus / "config_g1_tied.json")
    launch(
        2,
        flags(corpus, root / "dp", steps=3, per_device_train_batch_size=4),
        flags(corpus, root / "dp_eval_one_batch", steps=1, per_device_train_batch_size=4, eval_batches=1),
        flags(corpus, root / "tp", steps=6, checkpointing_steps=2, tp_size=2),
        flags(corpus, root / "tp_resumed", steps=6, checkpointing_steps=2, tp_size=2, resume=tp_checkpoint),
        flags(corpus, root / "pp", config_name=tied, checkpointing_steps=2, **PIPELINE),
        flags(corpus, root / "pp_resumed", config_name=tied, resume=root / "pp" / "checkpoints" / "step_2", **PIPELINE),
        flags(corpus, root / "fsdp", eval_batches=1, **FSDP),
        [*killed, "--resume=latest"],
    )
    return root


def test_two_process_data_parallel_equals_one_process(two_processes, reference_two_groups):
    """2 processes x 4 sequences == 1 process x 8 sequences. Each data-parallel replica computes its router losses
    on its own tokens, exactly as GShard's router groups do, so the 1-process reference uses router_num_groups=2.
    (`accelerate launch --cpu` starts one process, several CPU processes need MPI; torchrun starts two, and
    Accelerate picks them up as a multi-CPU (gloo) data-parallel run.)"""
    assert set(train_losses(two_processes / "dp")) == {1, 2, 3}
    assert_same_run(reference_two_groups, two_processes / "dp", steps=[1, 2, 3])


def test_evaluation_with_fewer_batches_than_replicas_finishes(two_processes):
    """One evaluation batch for two replicas: the replica without a batch must not wait in a collective of the other's
    forward (it hung in DDP's buffer broadcast); the loss is that one batch's."""
    evals = metrics(two_processes / "dp_eval_one_batch", "eval/loss")
    assert list(evals) == [1] and math.isfinite(evals[1])


def test_two_process_tensor_parallel_equals_one_process(two_processes, reference):
    """--tp_size 2: attention heads and experts split over the 2 processes (one replica); losses, router losses and
    gradient norms per step, and the saved whole model, equal the single process's."""
    assert set(train_losses(two_processes / "tp")) == set(range(1, 7))
    assert_same_run(reference, two_processes / "tp", steps=range(1, 7))
    assert_same_model(two_processes / "tp", reference)


def test_tensor_parallel_resume_equals_uninterrupted(two_processes, reference):
    """Resumed from the tensor-parallel run's step-4 checkpoint (every process's shards of model and optimizer)."""
    assert set(train_losses(two_processes / "tp_resumed")) == {5, 6}
    assert_same_run(reference, two_processes / "tp_resumed", steps=[5, 6])


def eval_loss(model_dir, corpus, batch_size, batches=2):
    """What `evaluate` computes (validation blocks, batches of `batch_size`), by the saved model in this process."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    blocks = pack(read_text_files([str(corpus / "train.txt")], "text"), AutoTokenizer.from_pretrained(model_dir), 32)
    blocks = blocks[-max(1, len(blocks) // 20):]
    total = count = 0
    with torch.no_grad():
        for i in range(0, min(len(blocks), batches * batch_size), batch_size):
            batch = blocks[i : i + batch_size]
            logits = model(batch).logits
            total += F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
            count += batch[:, 1:].numel()
    return total / count


def test_two_stage_pipeline_equals_one_process(two_processes, reference_tied_two_groups, corpus):
    """--pp_size 2 (layer 0 and the embeddings | layer 1, norm and the head tied to the embeddings), 2 microbatches:
    losses, router losses and metrics, gradient norms (the tied weight counted once) per step, the saved whole
    model and the evaluation (stages run forward one after another) equal the single process's."""
    run, reference = two_processes / "pp", reference_tied_two_groups
    assert set(train_losses(run)) == {1, 2, 3}
    extra = (("train/z_loss", 1e-4), ("expert_load_cv/layers.1", 1e-4))
    assert_same_run(reference, run, steps=[1, 2, 3], extra=extra)
    assert_same_model(run, reference)
    assert metrics(run, "eval/loss")[3] == pytest.approx(eval_loss(reference, corpus, batch_size=4), rel=1e-5)


def test_pipeline_resume_equals_uninterrupted(two_processes, reference_tied_two_groups):
    """Resumed from the pipeline run's step-2 checkpoint (each stage's model and optimizer)."""
    assert set(train_losses(two_processes / "pp_resumed")) == {3}
    assert_same_run(reference_tied_two_groups, two_processes / "pp_resumed", steps=[3])
    assert_same_model(two_processes / "pp_resumed", reference_tied_two_groups)


def test_fsdp_equals_one_process(two_processes, reference_two_groups, corpus):
    """--fsdp_size 2 (parameters, gradients and AdamW state sharded over the 2 processes): losses, router losses and
    metrics, gradient norms and the saved model equal the single process's; its evaluation of one batch (the other
    process runs the forward too, FSDP's all-gathers need both, and does not count it) is that batch's loss."""
    run = two_processes / "fsdp"
    assert min(metrics(run, "train/grad_norm").values()) > 0.5  # every step clipped (--max_grad_norm 0.5)
    assert_same_run(reference_two_groups, run, steps=[1, 2, 3], extra=(("expert_load_cv/layers.1", 1e-4),))
    assert_same_model(run, reference_two_groups)
    assert metrics(run, "eval/loss")[3] == pytest.approx(eval_loss(run, corpus, batch_size=4, batches=1), rel=1e-5)


def test_killed_fsdp_job_resumes_exactly(two_processes):
    """The whole torchrun job SIGKILLed after step 2 (checkpoint 1 complete, checkpoint 2 under way): --resume latest
    continues from step 1 and gives the uninterrupted run's losses and final model, each step logged once."""
    killed = json.loads((two_processes / "killed_status.json").read_text())
    assert killed["status"] == -signal.SIGKILL and killed["logged"] == [1, 2] and not killed["model_written"]
    assert "step_1" in killed["checkpoints"] and "step_2" not in killed["checkpoints"]
    run, uninterrupted = two_processes / "fsdp_killed", two_processes / "fsdp"
    assert [r["step"] for r in read_jsonl(run / "logs" / "metrics.jsonl") if "train/lm_loss" in r] == [1, 2, 3]
    assert_same_run(uninterrupted, run, steps=[2, 3], extra=(("train/lm_loss", 1e-6),))
    assert_same_model(run, uninterrupted)


@pytest.fixture(scope="module")
def four_processes(corpus, tmp_path_factory):
    """4 processes, one launch: --tp_size 2 (two tensor-parallel replicas of 4 sequences each), --pp_size 2 --tp_size 2
    (one replica, 2 microbatches of 4 sequences, each stage split over 2 processes), --fsdp_size 2 with 2 replicas
    (HSDP, 4 x 2 sequences), --fsdp_size 2 --tp_size 2 (2 x 4), --fsdp_size 2 --pp_size 2 (2 replicas of 2
    microbatches of 2, tied head), --fsdp_size 4 --ep_size 2 (experts over pairs of FSDP ranks, 2 copies sharded),
    --fsdp_size 2 --tp_size 2 --ep_size 4 (experts over both tensor-parallel groups) and --fsdp_size 2 --pp_size 2
    --ep_size 2 (the second stage's experts over its 2 FSDP ranks)."""
    root, tied = tmp_path_factory.mktemp("four_processes"), str(corpus / "config_g1_tied.json")
    launch(
        4,
        flags(corpus, root / "dp_tp", steps=3, per_device_train_batch_size=4, tp_size=2),
        flags(corpus, root / "pp_tp", tp_size=2, **PIPELINE),
        flags(corpus, root / "hsdp", config_name=tied, steps=3, per_device_train_batch_size=2, fsdp_size=2),
        flags(corpus, root / "fsdp_tp", tp_size=2, **FSDP),
        flags(corpus, root / "fsdp_pp", config_name=tied, fsdp_size=2,
              **{**PIPELINE, "per_device_train_batch_size": 2}),
        flags(corpus, root / "fsdp_ep", config_name=tied, steps=3, per_device_train_batch_size=2, fsdp_size=4, ep_size=2),
        flags(corpus, root / "fsdp_tp_ep", tp_size=2, ep_size=4, **FSDP),
        flags(corpus, root / "fsdp_pp_ep", config_name=tied, fsdp_size=2, ep_size=2,
              **{**PIPELINE, "per_device_train_batch_size": 2}),
    )
    return root


def test_four_processes_equal_one_process(four_processes, reference_two_groups):
    """--tp_size 2 with 2 replicas and --pp_size 2 --tp_size 2 == 1 process x 8 sequences."""
    assert_same_run(reference_two_groups, four_processes / "dp_tp", steps=[1, 2, 3])
    assert_same_run(reference_two_groups, four_processes / "pp_tp", steps=[1, 2, 3])
    assert_same_model(four_processes / "pp_tp", reference_two_groups)


@pytest.mark.parametrize(
    "run, reference",
    [("hsdp", "tied_four_groups"), ("fsdp_tp", "two_groups"), ("fsdp_pp", "tied_four_groups"),
     ("fsdp_ep", "tied_four_groups"), ("fsdp_tp_ep", "two_groups"), ("fsdp_pp_ep", "tied_four_groups")],
)
def test_sharded_layouts_equal_one_process(four_processes, run, reference, request):
    """DP x FSDP, FSDP x TP (PPMoE experts on the TP group), FSDP x PP (a tied head both stages hold, counted once in
    the norm) and expert parallelism wider than the TP group (also in a pipeline): losses, router losses and metrics, gradient norms and
    the saved model equal the single process's on the same rows (its router groups = the data-parallel processes'
    or microbatches' batches)."""
    reference = request.getfixturevalue(f"reference_{reference}")
    extra = (("train/z_loss", 1e-4), ("expert_load_cv/layers.1", 1e-4), ("dropped_fraction/layers.1", 1e-6))
    assert_same_run(reference, four_processes / run, steps=[1, 2, 3], extra=extra)
    assert_same_model(four_processes / run, reference)




def test_kill_and_resume_equals_uninterrupted(corpus, reference, tmp_path):
    run = tmp_path / "killed"
    result = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_STEP_5, *flags(corpus, run, steps=6, checkpointing_steps=2)],
        env=ENV, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == -9, result.stderr[-3000:]  # killed, not finished or failed
    assert set(train_losses(run)) == {1, 2, 3, 4, 5} and not (run / "model.safetensors").exists()

    main(_args(corpus, run, max_steps=6, checkpointing_steps=2, resume="latest"))  # from step 4
    resumed, expected = train_losses(run), train_losses(reference)
    assert resumed.keys() == expected.keys() == set(range(1, 7))
    assert len([r for r in read_jsonl(run / "logs" / "metrics.jsonl") if "train/lm_loss" in r]) == 6  # step 5 once
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-6), step
    assert not list((run / "checkpoints").glob("*.saving"))


def test_outputs_logs_and_plots(corpus, tmp_path):
    summary = main(_args(corpus, tmp_path, max_steps=2, plots=True))
    assert summary["step"] == 2 and summary["eval/loss"] > 0
    records = read_jsonl(tmp_path / "logs" / "metrics.jsonl")
    train = [r for r in records if "train/lm_loss" in r]
    assert {"train/aux_loss", "train/z_loss", "train/tokens_per_second", "expert_load_cv/layers.1",
            "dropped_fraction/layers.1"} <= set(train[-1])
    assert (tmp_path / "plots" / "loss.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "expert_load.png").stat().st_size > 1000
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert model.config.num_experts == 4 and len(tokenizer) <= model.config.vocab_size


def test_jsonl_and_datasets_sources(tmp_path):
    from hf_ppmoe.training.data import Source

    def load_texts(args):
        source = Source(args.train_file, args.dataset_name, args.dataset_config_name, args.dataset_split, args.text_column)
        return [text for batch in source.texts() for text in batch], None

    rows = [{"text": t} for t in builtin_corpus()[:3]]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts, _ = load_texts(TrainArguments(train_file=[str(tmp_path / "data.jsonl")]))
    assert texts == [r["text"] for r in rows]
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    texts, _ = load_texts(TrainArguments(dataset_name=str(tmp_path / "ds")))
    assert texts == [r["text"] for r in rows]
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="has no 'text' field"):
        load_texts(TrainArguments(train_file=[str(tmp_path / "bad.jsonl")]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(train_file=["/no/such/file.txt"]), "Data file /no/such/file.txt does not exist"),
        (dict(model_name_or_path="x", upcycle_from="y"), "Give only one of"),
        (dict(block_size=1), "--block_size must be >= 2"),
        (dict(eval_steps=0), "--eval_steps must be >= 1"),
        (dict(logging_steps=0), "--logging_steps must be >= 1"),
        (dict(max_grad_norm=-1.0), "--max_grad_norm must be >= 0"),
        (dict(mixed_precision="fp8"), "--mixed_precision 'fp8'"),
        (dict(resume="/no/checkpoint"), "no such checkpoint folder"),
        (dict(config_name="/no/config.json"), "does not exist"),
        (dict(pp_size=0), "--pp_size must be >= 1"),
        (dict(tp_size=2, mixed_precision="fp16"), "fp16 with --tp_size, --pp_size or --fsdp_size > 1"),
        (dict(pp_size=2, mixed_precision="fp16"), "fp16 with --tp_size, --pp_size or --fsdp_size > 1"),
        (dict(fsdp_size=2, mixed_precision="fp16"), "fp16 with --tp_size, --pp_size or --fsdp_size > 1"),
        (dict(fsdp_size=0), "--fsdp_size must be >= 1"),
        (dict(ep_size=4, fsdp_size=1), r"--ep_size 4 with --tp_size 1 --fsdp_size 1: .* Use --ep_size in \[1\]"),
        (dict(ep_size=3, tp_size=2, fsdp_size=2), r"Use --ep_size in \[2, 4\]"),
        (dict(ep_size=1, tp_size=2, fsdp_size=2), r"Use --ep_size in \[2, 4\]"),
    ],
)
def test_argument_errors_before_any_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainArguments(**kwargs).validate()


def test_errors_that_need_the_model_config(monkeypatch):
    config = GPTMoEConfig(num_experts=6, position_embedding_type="learned", max_position_embeddings=64)
    with pytest.raises(ValueError, match="--tp_size 4 does not divide num_experts=6"):
        TrainArguments(tp_size=4, block_size=32).check_model(config)
    with pytest.raises(ValueError, match="--block_size 128 exceeds the model's max_position_embeddings=64"):
        TrainArguments(block_size=128).check_model(config)
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="this gpt2 model has none"):
        TrainArguments(tp_size=2).check_model(GPT2Config())
    with pytest.raises(ValueError, match="--pp_size 2 cuts the model into stages .* this gpt2 model is not one"):
        TrainArguments(pp_size=2).check_model(GPT2Config())
    with pytest.raises(ValueError, match="--pp_size 3: the model has 2 layers, fewer than the pipeline stages"):
        TrainArguments(pp_size=3, block_size=32).check_model(GPTMoEConfig(num_hidden_layers=2))
    from types import SimpleNamespace

    from hf_ppmoe.training.parallel_setup import DataParallelGroup

    with pytest.raises(ValueError, match="--tp_size 2 needs a multiple of 2 processes; this job has 3"):
        DataParallelGroup(SimpleNamespace(process_index=0, num_processes=3), tp_size=2)
    with pytest.raises(ValueError, match="--pp_size 2 with --tp_size 2 needs a multiple of 4 processes; this job has 6"):
        DataParallelGroup(SimpleNamespace(process_index=0, num_processes=6), tp_size=2, pp_size=2)
    with pytest.raises(ValueError, match="--fsdp_size 4 with --tp_size 2 needs a multiple of 8 processes; this job has 4"):
        DataParallelGroup(SimpleNamespace(process_index=0, num_processes=4), tp_size=2, fsdp_size=4)
    with pytest.raises(ValueError, match="--ep_size 8 does not divide num_experts=6"):
        TrainArguments(ep_size=8, fsdp_size=8).check_model(GPTMoEConfig(num_experts=6))
    with pytest.raises(ValueError, match="--ep_size 2 splits experts; this gpt2 model has none"):
        TrainArguments(ep_size=2, fsdp_size=2).check_model(GPT2Config())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="--push_to_hub was given but HF_HUB_OFFLINE is set"):
        TrainArguments(push_to_hub=True).validate()


def test_cli_reports_bad_arguments_in_one_line(tmp_path):
    result = run_cli(["--train_file", str(tmp_path / "missing.txt"), "--output_dir", str(tmp_path)])
    assert result.returncode == 2
    assert "error: --train_file" in result.stderr and "no such file" in result.stderr and "Traceback" not in result.stderr


def test_help_text_formats():
    """argparse %-formats every help string: a literal % must be written %%."""
    text = " ".join(HfArgumentParser(TrainArguments).format_help().split())
    assert "N% of the training blocks" in text and "CRC-32 % 100" in text and "--pp_size" in text


def test_bf16_mixed_precision_trains(corpus, tmp_path):
    """--mixed_precision bf16 (CPU autocast here): the MoE layers run in bf16 and the run logs finite losses."""
    # its own process: Accelerate's state, set by the other in-process runs, cannot change precision
    result = run_cli(flags(corpus, tmp_path, steps=2, mixed_precision="bf16"))
    assert result.returncode == 0, result.stderr[-3000:]
    losses, evals = metrics(tmp_path), metrics(tmp_path, "eval/loss")
    assert set(losses) == {1, 2} and all(math.isfinite(v) for v in [*losses.values(), *evals.values()]) and evals
    # the run ends by printing its final evaluation (the LM loss alone, as logged)
    assert f"step 2: eval loss {evals[2]:.4f}, perplexity {math.exp(evals[2]):.2f}" in result.stdout, result.stdout[-500:]


def test_steps_between_logging_read_nothing_from_the_device(corpus, tmp_path, monkeypatch):
    """The training loop reads tensors on the host (a device sync on a GPU) only at logging, evaluation and checkpoint
    steps: 8 steps logged once make as many reads in train.py as 4 steps logged once. (The model's CPU-only input
    checks read too, by design, and are not counted: only reads made from train.py's own lines are.)"""
    reads = []

    def counting(method):
        def read(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename.endswith(os.path.join("training", "train.py")):
                reads.append(sys._getframe(1).f_lineno)
            return method(self, *args, **kwargs)
        return read

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
    counts = {}
    for steps in (4, 8):
        reads.clear()
        main(_args(corpus, tmp_path / str(steps), steps=steps, logging_steps=steps, eval_steps=steps))
        counts[steps] = sorted(reads)
    assert counts[4] == counts[8] and counts[4], counts
    logged = read_jsonl(tmp_path / "8" / "logs" / "metrics.jsonl")
    assert [r["step"] for r in logged if "train/lm_loss" in r] == [8]  # the mean over the 8 steps


def test_non_finite_loss_stops_the_run_and_saves_nothing_from_it(corpus, tmp_path):
    """A diverging run (learning rate 1e6, no clipping) stops with a clear error at the first non-finite loss; the
    checkpoint written before it stays, no later checkpoint or final model is written."""
    args = _args(corpus, tmp_path, max_steps=6, learning_rate=1e6, max_grad_norm=0, checkpointing_steps=1, warmup_steps=0)
    with pytest.raises(FloatingPointError, match=r"Training stopped at step (\d): the loss is not finite") as error:
        main(args)
    stopped = int(error.value.args[0].split("step ")[1].split(":")[0])
    saved = sorted(int(p.name.split("_")[1]) for p in tmp_path.glob("checkpoints/step_*[0-9]"))
    assert stopped > 1 and saved == list(range(1, stopped)), (stopped, saved)
    assert not list(tmp_path.glob("*.safetensors")) and not (tmp_path / "config.json").exists()
