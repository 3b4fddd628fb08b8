"""`hf-ppmoe plan` / `hf_ppmoe.plan`: per-rank memory and step time of every layout of a model on a cluster."""

from ..utils.lazy import lazy_names

_NAMES = {
    "GPU": "hardware", "GPUS": "hardware", "Cluster": "hardware", "EFFICIENCY_SOURCES": "hardware",
    "Layout": "layouts", "Run": "layouts", "Rank": "layouts",
    "ModelSpec": "shapes", "model_spec": "shapes",
}

__all__ = sorted(_NAMES)

__getattr__, __dir__ = lazy_names(__name__, _NAMES)
