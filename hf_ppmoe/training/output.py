"""What a finished run leaves in output_dir, and its upload: the final model (gathered whole from a split one),
tokenizer, model card with the last evaluation, plots, generation samples (Seq2Seq-MoE: chrF / BLEU of flat beam
search outputs), and `push` to the Hub. `write_outputs(run, evaluation)` takes train.py's `Run`."""

from __future__ import annotations

import json
from pathlib import Path

from ..utils.model_card import training_card, write_card
from .arguments import TrainArguments
from .pairs import generation_metrics
from .parallel_setup import gather_model
from .tracking import plot_training


def generate_and_score(model, run) -> dict:
    """chrF and BLEU of the final model's outputs (GShard flat beam search) for the first generation_eval_pairs
    validation pairs, and a few of them as samples (logs/samples.jsonl)."""
    args, pairs = run.args, run.data.validation_pairs
    pairs = pairs.select(range(min(args.generation_eval_pairs or len(pairs), len(pairs))))
    scores, outputs = generation_metrics(model, run.tokenizer, pairs, num_beams=args.generation_num_beams,
                                         max_new_tokens=args.max_target_length, max_source_length=args.max_source_length,
                                         batch_size=args.per_device_train_batch_size)
    with open(Path(args.output_dir, "logs", "samples.jsonl"), "w") as f:
        for pair, output in list(zip(pairs, outputs))[:8]:
            f.write(json.dumps({"source": pair["source"], "target": pair["target"], "generated": output}) + "\n")
    return scores


def write_outputs(run, evaluation: dict) -> None:
    """The final model (gathered whole from a split one: every process takes part), tokenizer and model card (with
    the last `evaluation`, completed by the generation metrics of a Seq2Seq-MoE) in output_dir, and plots."""
    accelerator, args, output_dir = run.accelerator, run.args, Path(run.args.output_dir)
    if run.dp.mesh is not None:  # the whole model, on rank 0
        unwrapped = gather_model(run.model, run.dp, run.pipe)
        if accelerator.is_main_process:
            unwrapped.save_pretrained(output_dir)
    else:
        unwrapped = accelerator.unwrap_model(run.model)
        unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save)
    if not accelerator.is_main_process:
        return
    run.tokenizer.save_pretrained(output_dir)
    if unwrapped.config.is_encoder_decoder:  # chrF / BLEU of flat-beam-search outputs, on the whole final model
        evaluation.update(generate_and_score(unwrapped, run))
        accelerator.log(evaluation, step=args.max_steps)
    write_card(output_dir, training_card(
        unwrapped, name=output_dir.resolve().name, source=args.model_name_or_path or args.upcycle_from,
        datasets=[args.dataset_name], evaluation=evaluation,
    ))
    if args.plots:
        plot_training(output_dir / "logs" / "metrics.jsonl", output_dir / "plots")


def push(args: TrainArguments) -> None:
    """Upload the output folder as it was saved (model, tokenizer, model card, logs and plots; not the checkpoints)."""
    from huggingface_hub import HfApi

    repo_id = args.hub_model_id or Path(args.output_dir).resolve().name
    try:
        api = HfApi()
        repo_id = api.create_repo(repo_id, exist_ok=True).repo_id
        api.upload_folder(repo_id=repo_id, folder_path=args.output_dir, ignore_patterns=["checkpoints/*", ".*"])
    except Exception as error:  # network, authentication, offline mode: say what to do
        raise RuntimeError(
            f"Pushing to the Hub repository {repo_id!r} failed ({type(error).__name__}: {error}). The trained model is "
            f"saved in {args.output_dir}; log in with `hf auth login` and upload it with `hf upload {repo_id} {args.output_dir}`."
        ) from error
