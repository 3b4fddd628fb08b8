"""`hf-ppmoe plan` / `hf_ppmoe.plan`: per-rank memory (parameters, gradients, optimizer state, activations, FSDP's
gathered layers, communication buffers) and step time (compute, all-reduce, all-to-all, pipeline bubble) of every
layout of a model on a cluster, ranked; docs/parallel.md.

    hardware.py       GPU presets from NVIDIA's data sheets, one efficiency factor per GPU kind; Cluster
    layouts.py        Layout (dp, fsdp, pp, tp, ep as hf_ppmoe.training splits), Run (one optimizer step), Rank
    shapes.py         a config's parameters and plan styles (its model built on the meta device)
    state.py          parameters, gradients, optimizer state per rank; FSDP's gathered layers; buffers
    activations.py    what autograd saves for the backward, per layer and stage
    communication.py  the collectives per layer and step, and their time
    timing.py         step time: compute, collectives, bubble, data parallel, optimizer
    search.py         every layout, the fastest micro-batch that fits, ranked
    sources.py        the model from a folder, a config.json, or a dense model and upcycle options
    plans.py          `plan(...)`, its text and JSON
    command.py        `hf-ppmoe plan` (its flags need only the standard library)

Nothing here needs torch.distributed: a plan is arithmetic on a config.
"""

from ..utils.lazy import lazy_names

_NAMES = {
    "GPU": "hardware", "GPUS": "hardware", "Cluster": "hardware", "EFFICIENCY_SOURCES": "hardware",
    "Layout": "layouts", "Run": "layouts", "Rank": "layouts",
    "ModelSpec": "shapes", "model_spec": "shapes",
    "Plan": "search", "Estimate": "search", "Memory": "search", "plan_layouts": "search",
    "plan": "plans", "format_plan": "plans", "plan_dict": "plans",
    "model_config": "sources",
}

__all__ = sorted(_NAMES)

__getattr__, __dir__ = lazy_names(__name__, _NAMES)
