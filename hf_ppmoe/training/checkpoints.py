"""Training checkpoints: the `Checkpointer` that writes and reads them (checkpoints/step_N), what a checkpoint records
about its run, and the checks that make `--resume` continue that run or refuse.

A checkpoint folder holds Accelerate's state (model, optimizer, scheduler, RNG states of every process), a split
model's and its optimizer's shards (`sharded_model_optimizer/`, torch.distributed.checkpoint, every process writing
its own), each process's data position (`data_state_<process>.pt`, streamed data) and `trainer_state.json`.

Every checkpoint's `trainer_state.json` (written last, when the checkpoint is complete) holds:

    step          the optimizer steps done
    run_id        the run it belongs to: a fresh run draws one, a resumed run keeps its checkpoint's
    arguments     the run's TrainArguments, as JSON
    model_config  the model's config (the fields that decide its computation)
    data          the training data's fingerprint (block_data.py: prepared, the blocks' sha256; streamed, that of the
                  source, tokenizer, block size and shuffle buffer)
    num_processes the processes that wrote it (each has its own RNG state, and with --tp_size / --pp_size its shards)
    changes       settings changed on earlier resumes with --allow_resume_changes, and at which step
    files         the size of every file in the checkpoint

Resuming compares them with the new run before anything is loaded:
- a file whose size differs from the one written (a truncated model, optimizer or RNG state file: a full disk or a
  copy cut short) is refused, naming the file and the newest intact earlier checkpoint of the same run;
- the layout (`--tp_size`, `--pp_size`, the number of processes) must be the checkpoint's: its model, optimizer and
  RNG states are split that way ("this checkpoint was written with --tp_size 2");
- any other setting that changes the run's trajectory (learning rate, batch size, seed, schedule, the model config
  such as its gate, the data) is refused with the list of differences, unless each is named in
  `--allow_resume_changes`; accepted changes are printed, logged to metrics.jsonl and kept in later checkpoints.

`--resume latest` takes the newest complete checkpoint of the run that last started training in `output_dir` (its
`run_id` is in `logs/run_config.json`, written when training starts), never one left by an earlier run there.
"""

from __future__ import annotations

import json
import uuid
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from accelerate.utils import broadcast_object_list, extract_model_from_parallel
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..parallel.checkpoint import load_distributed_checkpoint
from ..utils.atomic import atomic_folder

CHECKPOINT_PREFIX = "step_"
STATE_FILE = "trainer_state.json"
SHARDED = "sharded_model_optimizer"  # a checkpoint's subfolder for a split model (tp/pp/fsdp) and its optimizer
DATA_STATE = "data_state_"  # + process index + ".pt": the data position of each process (streamed data)

# arguments that may differ on resume: where the model and data come from (what they are is compared through
# model_config and data), evaluation, logging, checkpointing and output, and FSDP's memory-for-communication trade
MAY_CHANGE_ON_RESUME = frozenset(
    """fsdp_reshard_after_forward model_name_or_path config_name upcycle_from num_experts num_experts_per_tok router_type router_init
    noise_std expert_noise_std tokenizer_name train_file validation_file dataset_name dataset_config_name dataset_split
    text_column sample_by data_cache_dir output_dir eval_steps eval_batches logging_steps checkpointing_steps resume report_to plots
    push_to_hub hub_model_id allow_resume_changes""".split()
)
LAYOUT = ("tp_size", "pp_size")  # with num_processes: how the checkpoint's states are split; never changed on resume
# config fields that name or describe a model without changing what it computes
_CONFIG_LABELS = frozenset(
    """_name_or_path architectures auto_map transformers_version dtype torch_dtype distributed_config conversion
    id2label label2id""".split()
)


def new_run_id() -> str:
    return uuid.uuid4().hex


def run_record(args, model_config, data_fingerprint: str, num_processes: int, run_id: str) -> dict:
    """What every checkpoint of this run records about it (see the module docstring); `data_fingerprint` is the
    training data's (`data.fingerprint`: what decides its batches)."""
    config = {k: v for k, v in model_config.to_dict().items() if k not in _CONFIG_LABELS}
    return {
        "run_id": run_id,
        "arguments": json.loads(args.to_json()),
        "model_config": json.loads(json.dumps(config, default=str)),
        "data": data_fingerprint,
        "num_processes": num_processes,
        "changes": [],
    }


def write_state(folder: Path, step: int, record: dict) -> None:
    """trainer_state.json, the last file of a checkpoint: the run's record and the size of every other file."""
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    (folder / STATE_FILE).write_text(json.dumps({"step": step, **record, "files": files}, indent=1))


def _step(path: Path) -> int:
    return int(path.name.removeprefix(CHECKPOINT_PREFIX))


def _read_state(path: Path) -> dict | None:
    try:
        return json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _damage(path: Path, state: dict) -> list[str]:
    """The files of a checkpoint that are not as they were written."""
    problems = []
    for name, size in state.get("files", {}).items():
        file = path / name
        if not file.is_file():
            problems.append(f"{file} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{file} has {file.stat().st_size} bytes, {size} were written (truncated or damaged)")
    return problems


def _completed(root: Path) -> list[tuple[Path, dict]]:
    """(folder, state) of the complete checkpoints under `root`, oldest first."""
    found = []
    for path in root.glob(f"{CHECKPOINT_PREFIX}*[0-9]"):
        if path.name.removeprefix(CHECKPOINT_PREFIX).isdigit() and (state := _read_state(path)) is not None:
            found.append((path, state))
    return sorted(found, key=lambda item: _step(item[0]))


def current_run_id(output_dir) -> str | None:
    """The run that last started training in `output_dir` (None: none did, or one from before run ids)."""
    try:
        return json.loads(Path(output_dir, "logs", "run_config.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def find_checkpoint(args) -> Path | None:
    """The checkpoint `--resume` names: a folder, or for `latest` the newest complete checkpoint of the run that last
    trained in output_dir (checkpoints of an earlier run there are not taken)."""
    if not args.resume:
        return None
    if args.resume != "latest":
        return Path(args.resume)
    root = Path(args.output_dir, "checkpoints")
    done = _completed(root)
    run_id = current_run_id(args.output_dir)
    if run_id is not None:
        earlier = [path.name for path, state in done if state.get("run_id") != run_id]
        done = [(path, state) for path, state in done if state.get("run_id") == run_id]
        if not done and earlier:
            raise ValueError(
                f"--resume latest: the last run that trained in {args.output_dir} (run id {run_id}) wrote no checkpoint; "
                f"{', '.join(earlier)} in {root} belong to an earlier run. To continue that run, name its checkpoint: "
                f"--resume {root / earlier[-1]}."
            )
    if not done:
        raise ValueError(f"--resume latest: no complete checkpoint in {root}.")
    return done[-1][0]


def read_checkpoint(path: Path) -> dict:
    """The checkpoint's state, after checking that every file it lists is there with the size it was written with.
    Raises ValueError naming the damaged files and the newest intact earlier checkpoint of the same run."""
    state = _read_state(path)
    if state is None:
        raise ValueError(
            f"{path} is not a complete checkpoint: {path / STATE_FILE}, written last by a save, is missing or unreadable."
            + _earlier(path, None)
        )
    problems = _damage(path, state)
    if problems:
        raise ValueError(f"Checkpoint {path} is damaged: {'; '.join(problems)}." + _earlier(path, state.get("run_id")))
    return state


def _earlier(path: Path, run_id: str | None) -> str:
    """A sentence naming the newest intact checkpoint before `path` of the same run (of any run if unknown)."""
    if not path.name.removeprefix(CHECKPOINT_PREFIX).isdigit():
        return ""
    intact = [
        p for p, state in _completed(path.parent)
        if _step(p) < _step(path) and (run_id is None or state.get("run_id") == run_id) and not _damage(p, state)
    ]
    if not intact:
        return " No intact earlier checkpoint of this run is left."
    return f" The newest intact earlier checkpoint is {intact[-1]}: resume from it with --resume {intact[-1]}."


def _show(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def check_resume(saved: dict, current: dict, allowed: list[str] | None) -> dict[str, list]:
    """Compare a checkpoint's record with the new run's. Raises ValueError for a different layout, and for other
    differences not named in `allowed`; returns the accepted ones ({name: [checkpoint's, this run's]})."""
    if "arguments" not in saved:  # written before checkpoints recorded their run: nothing to compare
        return {}
    old, new = saved["arguments"], current["arguments"]
    layout = [
        f"--{name} {old.get(name, 1)} (this run: --{name} {new.get(name, 1)})" for name in LAYOUT
        if old.get(name, 1) != new.get(name, 1)
    ]
    if saved.get("num_processes") != current["num_processes"]:
        layout.append(f"{saved.get('num_processes')} processes (this run has {current['num_processes']})")
    if layout:
        raise ValueError(
            f"this checkpoint was written with {' and '.join(layout)}: its model, optimizer and random states are split "
            "that way. Resume it with the same --tp_size / --pp_size and number of processes."
        )
    # names both records have (an argument or config field added by a later version has nothing to compare with)
    changed = {
        name: [old[name], new[name]] for name in sorted(set(old) & set(new))
        if name not in MAY_CHANGE_ON_RESUME and old[name] != new[name]
    }
    config_old, config_new = saved.get("model_config", {}), current["model_config"]
    for key in sorted(set(config_old) & set(config_new)):
        if config_old[key] != config_new[key]:
            changed[f"config.{key}"] = [config_old[key], config_new[key]]
    if saved.get("data") != current["data"]:
        changed["data"] = [f"sha256 {str(saved.get('data'))[:12]}", f"sha256 {current['data'][:12]}"]
    refused = [name for name in changed if name not in (allowed or [])]
    if refused:
        listed = "; ".join(f"{name}: {_show(changed[name][0])} -> {_show(changed[name][1])}" for name in refused)
        raise ValueError(
            f"this run's settings differ from the checkpoint's ({listed}). A resumed run continues the checkpoint's "
            f"run; use its settings, or accept the changes with --allow_resume_changes {' '.join(refused)} (they are "
            "logged)."
        )
    return changed


def sharded_state(model, optimizer, stage: int | None = None) -> dict:
    """Model and optimizer state for torch.distributed.checkpoint; a pipeline stage's under its own key (the stages
    number their layers from 0 alike; the replicas of a stage write it once)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    return state if stage is None else {f"stage_{stage}": state}


def load_sharded(path: Path, model, optimizer, stage: int | None = None) -> None:
    """Read `sharded_state`'s files into `model` and `optimizer` (refusing pickled code: parallel.checkpoint)."""
    state = sharded_state(model, optimizer, stage)
    load_distributed_checkpoint(state, path)
    state = state if stage is None else state[f"stage_{stage}"]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def drop_tied_copies(models, weights, output_dir=None) -> None:
    """Accelerate's save-state hook: leave out of each model's state dict the tensors the model declares tied to
    another it holds (Transformers' `all_tied_weights_keys`: `lm_head.weight` with tied embeddings) and that share
    its memory. Safetensors holds one copy of shared memory, so Accelerate drops them itself, with a notice on every
    checkpoint ("Removed shared tensor ... This should be OK, but check ..."); the file is the same either way, and
    loading into the model, which ties them, fills both. A tensor that shares memory without being declared tied is
    left for Accelerate to name."""
    for model, state in zip(models, weights):
        tied = getattr(extract_model_from_parallel(model), "all_tied_weights_keys", None) or {}
        for target, source in tied.items():
            for name in [n for n in state if n == target or n.endswith("." + target)]:  # "module." under DDP
                twin = name[: len(name) - len(target)] + source
                if twin in state and _same_memory(state[name], state[twin]):
                    del state[name]


def _same_memory(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device == b.device
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


class Checkpointer:
    """Writes and reads a run's checkpoints, as torchtitan's `CheckpointManager`: the loop says `save(step)` and
    `load(folder)`, and this object knows what a checkpoint holds.

    accelerator  Accelerate's state (model, optimizer, scheduler, RNG) is saved and loaded through it
    output_dir   checkpoints go to output_dir/checkpoints/step_N
    record       what every checkpoint records about the run (`run_record`)
    sharded      (model, optimizer, pipeline stage or None) that Accelerate does not hold (a split model), saved
                 by every process into SHARDED with torch.distributed.checkpoint
    data         the training data; its position (`data.state_dict()`, when it has one) is saved per process
    """

    def __init__(self, accelerator, output_dir, record: dict, sharded: tuple | None = None, data=None):
        self.accelerator, self.root = accelerator, Path(output_dir, "checkpoints")
        self.record, self.sharded, self.data = record, sharded, data
        accelerator.register_save_state_pre_hook(drop_tied_copies)

    def folder(self, step: int) -> Path:
        return self.root / f"{CHECKPOINT_PREFIX}{step}"

    def save(self, step: int) -> Path:
        """Write checkpoints/step_N: into a temporary folder that replaces it in one step when complete
        (hf_ppmoe.utils.atomic: a killed or failed save leaves no checkpoint, or the earlier one of that step);
        trainer_state.json last. Every process calls it."""
        accelerator, final = self.accelerator, self.folder(step)
        with atomic_folder(final, overwrite=True) if accelerator.is_main_process else nullcontext() as staging:
            (staging,) = broadcast_object_list([staging])  # the main process's temporary folder, written by all
            accelerator.save_state(str(staging))
            if self.sharded is not None:
                dcp.save(sharded_state(*self.sharded), checkpoint_id=staging / SHARDED)
            if self.data is not None and (position := self.data.state_dict()):
                torch.save(position, staging / f"{DATA_STATE}{accelerator.process_index}.pt")
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                write_state(staging, step, self.record)
        accelerator.wait_for_everyone()
        return final

    def load(self, folder: Path) -> None:
        """Accelerate's state, a split model's shards and this process's data position from `folder` (checked
        first with `read_checkpoint`)."""
        self.accelerator.load_state(str(folder))
        if self.sharded is not None:
            load_sharded(folder / SHARDED, *self.sharded)
        position = folder / f"{DATA_STATE}{self.accelerator.process_index}.pt"
        if self.data is not None and position.is_file():
            self.data.load_state_dict(torch.load(position, weights_only=True))
