"""What a finished run leaves in output_dir, and its upload: the final model (gathered whole from a split one),
tokenizer, model card with the last evaluation, plots, and `push` to the Hub. `final_model(run)` and
`write_outputs(run, model, evaluation)` take train.py's `Run`; the evaluation is the caller's (a Seq2Seq-MoE's chrF /
BLEU: `pairs.generate_and_score`)."""

from __future__ import annotations

from pathlib import Path

from ..utils.model_card import training_card, write_card
from .arguments import TrainArguments
from .parallel_setup import gather_model
from .tracking import plot_training


def final_model(run):
    """The whole final model: gathered from a split one (every process takes part; rank 0 receives it) or
    unwrapped from Accelerate's wrapper."""
    if run.dp.mesh is not None:
        return gather_model(run.model, run.dp, run.pipe)
    return run.accelerator.unwrap_model(run.model)


def write_outputs(run, model, evaluation: dict) -> None:
    """The final `model` (`final_model`; every process takes part), tokenizer and model card (with `evaluation`) in
    output_dir, and plots."""
    accelerator, args, output_dir = run.accelerator, run.args, Path(run.args.output_dir)
    if run.dp.mesh is not None:  # the whole model is on rank 0
        if accelerator.is_main_process:
            model.save_pretrained(output_dir)
    else:
        model.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save)
    if not accelerator.is_main_process:
        return
    run.tokenizer.save_pretrained(output_dir)
    write_card(output_dir, training_card(
        model, name=output_dir.resolve().name, source=args.model_name_or_path or args.upcycle_from,
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
