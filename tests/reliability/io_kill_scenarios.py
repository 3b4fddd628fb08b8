"""Run by test_atomic_saves.py as `python io_kill_scenarios.py ROOT`: saves, conversions and training checkpoints
killed by real signals, and run out of space, at the moments the issue found them broken. Prints one JSON line per
scenario with what was observed; the test file judges it.

Importing torch, Transformers and hf_ppmoe is the slow part, so this process imports once and forks a process for
each write that gets killed (one thread, no OpenMP pool: forking is safe). A killed write's process kills itself
with the signal at the named moment; this process then looks at what is on disk, loads it, and writes again.
"""

import contextlib
import io
import json
import os
import resource
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers

from helpers import tiny_gpt_config  # noqa: E402

from hf_ppmoe import GPTMoEForCausalLM  # noqa: E402


def fingerprint(path: Path):
    """What a reader of `path` would see: the folder's identity and its entries' identities."""
    try:
        return os.stat(path).st_ino, sorted((p.name, p.stat().st_ino) for p in path.iterdir())
    except FileNotFoundError:
        return None


def killed(sig: int, action, *, target: Path | None = None, after=None, rename_only: bool = False) -> int | str:
    """Run `action` in a forked process that kills itself with `sig`: right after the first rename or deletion that
    changes what `target` shows, or right after the callable `after` (a wrapped method) returns. Returns the signal
    that ended it, or what else happened."""
    pid = os.fork()
    if pid == 0:
        try:
            def die():
                os.kill(os.getpid(), sig)
                time.sleep(60)

            if target is not None:
                before = fingerprint(target)

                def watch(fn):
                    def wrapped(*args, **kwargs):
                        result = fn(*args, **kwargs)
                        if fingerprint(target) != before:
                            die()
                        return result
                    return wrapped

                os.replace, os.rename, os.unlink, shutil.rmtree = map(watch, (os.replace, os.rename, os.unlink, shutil.rmtree))
                with contextlib.suppress(ImportError):
                    import hf_ppmoe.utils.atomic as atomic

                    atomic._exchange = (lambda a, b: False) if rename_only else watch(atomic._exchange)
            if after is not None:
                owner, name = after
                method = getattr(owner, name)
                setattr(owner, name, lambda *a, **k: (method(*a, **k), die()))
            action()
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(3)  # reached only when the process was not killed
    _, status = os.waitpid(pid, 0)
    return signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"


def out_of_space(action) -> str:
    """Run `action` with files limited to 16 KiB (the kernel refuses larger writes: EFBIG); what it raised."""
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, resource.RLIM_INFINITY))
    try:
        action()
        return "no error"
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        signal.signal(signal.SIGXFSZ, previous)


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def save_pretrained(root: Path) -> dict:
    """A sharded checkpoint overwritten by a save with another config and other weights."""
    models = {}
    for version, coef in (("old", 0.01), ("new", 0.02)):
        torch.manual_seed(len(models))
        models[version] = GPTMoEForCausalLM(tiny_gpt_config(router_aux_loss_coef=coef)).eval()
    target = root / "model"
    models["old"].save_pretrained(target, max_shard_size="20KB")  # 7 shards; the new save writes 1 file
    (target / "tokenizer.json").write_text("{}")

    def loads_as():
        try:
            loaded = GPTMoEForCausalLM.from_pretrained(target)
        except Exception as error:
            return f"{type(error).__name__}: {str(error)[:300]}"
        config = {0.01: "old", 0.02: "new"}.get(loaded.config.router_aux_loss_coef, "?")
        weights = [v for v, m in models.items() if all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), loaded.state_dict().values()))]
        return f"config {config}, weights {weights[0] if weights else '?'}"

    new_save = lambda: models["new"].save_pretrained(target)  # noqa: E731
    report = {"full_disk_error": out_of_space(new_save), "after_full_disk": loads_as(), "leftovers_after_full_disk": hidden(root)}
    report["signal"] = killed(signal.SIGKILL, new_save, target=target)
    report["after_kill"] = loads_as()
    report["tokenizer_kept"] = (target / "tokenizer.json").is_file()
    report["leftovers_after_kill"] = hidden(root)
    new_save()
    report["after_next_save"] = loads_as()
    report["leftovers_after_next_save"] = hidden(root)
    return report


def conversion(root: Path) -> dict:
    """`hf-ppmoe upcycle --overwrite` run out of space, then sent SIGTERM between its two renames (as on a filesystem
    without an atomic exchange of two folders; handled as SIGINT: the old OUT is put back), then converted again."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from hf_ppmoe_cli import main as cli
    from hf_ppmoe.conversion import upcycle

    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=1)).eval()
    dense.save_pretrained(root / "dense")
    out = root / "moe"
    ids = torch.randint(0, 97, (2, 7))
    expected = dense(ids).logits

    def loads_as():
        try:
            loaded = AutoModelForCausalLM.from_pretrained(out).eval()
        except Exception as error:
            return f"{type(error).__name__}: {str(error)[:300]}"
        exact = torch.allclose(loaded(ids).logits, expected, atol=1e-5)
        return f"{loaded.config.num_experts} experts, {'equal' if exact else 'different'} logits"

    convert = lambda experts: cli(["upcycle", str(root / "dense"), str(out), "--num_experts", str(experts), "--overwrite", "--max_shard_size", "20KB"])  # noqa: E731
    with contextlib.redirect_stderr(io.StringIO()):
        convert(4)
    report = {"full_disk_error": out_of_space(lambda: upcycle(root / "dense", num_experts=2, save_directory=out, overwrite=True))}
    report["after_full_disk"], report["leftovers_after_full_disk"] = loads_as(), hidden(root)
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        report["cli_full_disk"] = [out_of_space(lambda: report.setdefault("cli_exit_code", convert(2))), stderr.getvalue()[-400:]]
    report["signal"] = killed(signal.SIGTERM, lambda: convert(2), target=out, rename_only=True)
    report["out_exists_after_kill"], report["leftovers_after_kill"] = out.is_dir(), len(hidden(root))
    with contextlib.redirect_stderr(io.StringIO()) as stderr:  # the next conversion first puts the old OUT back
        try:  # refused: by the flags' check (SystemExit) now that the killed conversion put the old OUT back
            code = cli(["upcycle", str(root / "dense"), str(out), "--num_experts", "2"])
        except SystemExit as exit:
            code = exit.code
        report["without_overwrite"] = [code, stderr.getvalue()[-300:]]
    report["after_kill"] = loads_as()
    with contextlib.redirect_stderr(io.StringIO()):
        convert(2)
    report["after_next_conversion"], report["leftovers_after_next_conversion"] = loads_as(), hidden(root)
    return report


def checkpoint(root: Path) -> dict:
    """Training checkpoints (`Checkpointer.save`) run out of space and killed after Accelerate wrote its state."""
    from accelerate import Accelerator

    from hf_ppmoe.training.arguments import TrainArguments
    from hf_ppmoe.training.checkpoints import Checkpointer, find_checkpoint

    accelerator = Accelerator(cpu=True)
    model = GPTMoEForCausalLM(tiny_gpt_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(3, 97, (2, 8)), labels=torch.randint(3, 97, (2, 8))).loss.backward()
    optimizer.step()
    model, optimizer = accelerator.prepare(model, optimizer)
    args = TrainArguments(output_dir=str(root / "run"), resume="latest")
    folder = root / "run" / "checkpoints"
    listing = lambda: sorted(p.name for p in folder.iterdir())  # noqa: E731
    record = {"run_id": "scenario"}  # what the checkpoint records of its run (hf_ppmoe.training.checkpoints)
    checkpointer = Checkpointer(accelerator, args.output_dir, record)

    checkpointer.save(2)
    report = {"full_disk_error": out_of_space(lambda: checkpointer.save(4)), "after_full_disk": listing()}
    report["signal"] = killed(signal.SIGKILL, lambda: checkpointer.save(4),
                              after=(accelerator, "save_state"))
    report["after_kill"] = listing()
    latest = find_checkpoint(args)
    accelerator.load_state(str(latest))
    report["resumes_from"] = latest.name
    checkpointer.save(6)  # a later save, as the resumed run makes
    report["after_next_save"] = listing()
    return report


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for scenario in (save_pretrained, conversion, checkpoint):
        folder = root / scenario.__name__
        folder.mkdir(parents=True)
        try:
            report = scenario(folder)
        except Exception:
            report = {"error": traceback.format_exc()[-3000:]}
        print(json.dumps({"scenario": scenario.__name__, **report}), flush=True)
