"""`hf-ppmoe demo`: the main job. The GPT demo (`gpt.py`) runs the fixed protocol of `protocol.py` (the experiment
`benchmarks/quality.py` runs at more arms) and states only what its seeds support (`report.py`); `--seq2seq` runs
the Seq2Seq-MoE comparison (`seq2seq.py`).

Names load on first use, so that `hf-ppmoe demo --help` prints before torch is imported."""

from ..utils.lazy import lazy_names

__all__ = ["DemoArguments", "run_demo"]

__getattr__, __dir__ = lazy_names(__name__, {"DemoArguments": "options", "run_demo": "gpt"})
