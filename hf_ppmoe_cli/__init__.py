"""`hf-ppmoe` command line: `hf-ppmoe demo [...]`, `hf-ppmoe train [...]` (= `python -m hf_ppmoe.training`),
`hf-ppmoe upcycle|merge|import SRC OUT [...]`, `hf-ppmoe export SRC OUT --to NAME`,
`hf-ppmoe megatron to-megatron|to-hf ...`, `hf-ppmoe serve MODEL`, `hf-ppmoe --version`; `hf-ppmoe COMMAND --help` for each.

Exit codes: 0 done; 2 bad flags or a refusal (one `hf-ppmoe COMMAND: error: ...` line, checked before any work,
nothing written; a mistyped command names the closest one); 1 a failure while running (a full disk, a diverged
training run).

This launcher lies outside the `hf_ppmoe` package because importing that package imports torch and Transformers and
registers our models with the Auto classes (seconds): the command list, `--help` and `--version` are answered here
with the standard library alone, and a command imports what it needs (`hf_ppmoe.cli.run`)."""

from __future__ import annotations

import difflib
import sys

COMMANDS = {
    "demo": "The main job: MoE vs dense at equal FLOPs per token, and upcycling, on the standard library (--tokens: budget).",
    "train": "Train or fine-tune a causal LM (data / tensor / expert / pipeline parallel): hf-ppmoe train --help.",
    "upcycle": "Turn a dense checkpoint (GPT-2, Llama, Mistral, Qwen2, Qwen3; T5) into an MoE model: hf-ppmoe upcycle SRC OUT.",
    "merge": "Merge an MoE model's experts back into its dense architecture: hf-ppmoe merge SRC OUT.",
    "import": "Import an MoE checkpoint (Mixtral, Qwen3-MoE, GLM-4-MoE; Switch Transformers) into our classes: hf-ppmoe import SRC OUT.",
    "export": "Export to Transformers' own MoE classes (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4-MoE, Switch): hf-ppmoe export SRC OUT --to NAME.",
    "serve": "OpenAI-compatible server (Transformers' own, continuous batching) for a saved model: hf-ppmoe serve MODEL.",
    "megatron": "GPT-MoE <-> Megatron-LM checkpoints: hf-ppmoe megatron to-megatron|to-hf ... (--help).",
    "plan": "Per-GPU memory and step time of every layout of a model on a cluster, ranked: hf-ppmoe plan MODEL --gpus N.",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--version":
        from importlib.metadata import version

        print(f"hf-ppmoe {version('hf-ppmoe')}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        usage = "usage: hf-ppmoe COMMAND [--help] | hf-ppmoe --version"
        listing = "\n".join(f"  {name:<8} {help}" for name, help in COMMANDS.items())
        if argv and argv[0] in ("-h", "--help"):
            print(f"{usage}\n\ncommands:\n{listing}")
            return 0
        if not argv:
            print(f"{usage}\n\ncommands:\n{listing}\nhf-ppmoe: error: no command given", file=sys.stderr)
            return 2
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"did you mean 'hf-ppmoe {close[0]}'?" if close else f"the commands: {', '.join(COMMANDS)}."
        print(f"{usage}\nhf-ppmoe: error: unknown command {argv[0]!r}; {hint}", file=sys.stderr)
        return 2
    from hf_ppmoe.cli import run

    return run(argv[0], argv[1:], COMMANDS[argv[0]])


if __name__ == "__main__":
    sys.exit(main())
