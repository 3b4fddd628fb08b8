"""Every use of Transformers' private API in hf_ppmoe, behind one small adapter: what to re-check when Transformers
changes. Checked against transformers 5.24 (`TRANSFORMERS_CHECKED`).

- `register_auto_names`: our model types written into the Auto classes' lazy name tables (`CONFIG_MAPPING._mapping`,
  each model mapping's `_model_mapping` / `_reverse_config_mapping`, the `_modules` caches), as Transformers lists its
  own models; `hf_ppmoe/__init__.py` falls back on the public `register` API where they are not as expected.
- `PrivateHooks`: overrides of two private hooks of `PreTrainedModel`, `_resolve_parallel_plans` and
  `_load_pretrained_model`, which hand over to public methods of our model class (`keep_own_plan_rules`,
  `load_guarded`, and `weight_loading_quantizer`: the quantizer in the private `LoadStateDictConfig` that the weights
  load with).
- the instance plans `_tp_plan` / `_ep_plan` (`restrict_instance_plans`), the split records `_device_mesh` /
  `_tp_size` (`record_split`, `device_mesh_of`), the pipeline stage `_pp_stage` (`is_first_pipeline_stage`), the
  output-recorder registry `_CAN_RECORD_REGISTRY` (`register_output_recorders`), `config._attn_implementation`
  (`attention_implementation`), and the expert-parallel marker `_is_expert_parallel` (`mark_expert_parallel`).

Not routed through here: the quantizer classes and `ConversionOps` that hf_ppmoe.modeling.quantization subclasses
(Transformers' quantizer API, the way a quantization method plugs into its loading), the class attribute `_tp_plan`
of a task head (the documented way a Transformers model file declares its head's rule), and
`generation/flat_beam_search.py`, which is written into checkpoints as a self-contained `custom_generate` file and so
reads `config._attn_implementation` itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing torch or the model classes would cost `import hf_ppmoe` (it registers through here)
    from torch import nn
    from transformers import PreTrainedModel

TRANSFORMERS_CHECKED = "5.24"


def register_auto_names(models: dict[str, tuple[str, dict[str, str]]], package: ModuleType) -> bool:
    """Teach the Auto classes our model types the way they know Transformers' own: by name, each resolved on first use
    through `package`'s `__getattr__`. `models`: model_type -> (config class name, {Auto class name: model class
    name}). Returns False, writing nothing, where the tables are not as expected."""
    from transformers.models.auto import configuration_auto, modeling_auto

    autos = {auto for _, classes in models.values() for auto in classes}
    mappings = {name: getattr(modeling_auto, name)._model_mapping for name in sorted(autos)}
    config_mapping = configuration_auto.CONFIG_MAPPING
    tables = [config_mapping, *mappings.values()]
    if not all(hasattr(t, "_modules") for t in tables) or not hasattr(config_mapping, "_mapping") or not all(
        hasattr(m, attr) for m in mappings.values() for attr in ("_reverse_config_mapping", "_model_mapping")
    ):
        return False
    for model_type, (config_name, classes) in models.items():
        module_name = configuration_auto.model_type_to_module_name(model_type)
        config_mapping._mapping[model_type] = config_name  # CONFIG_MAPPING_NAMES: one table, shared by every mapping
        config_mapping._modules[module_name] = package
        for auto, model_name in classes.items():
            mapping = mappings[auto]
            mapping._reverse_config_mapping[config_name] = model_type
            mapping._model_mapping[model_type] = model_name
            mapping._modules[module_name] = package
    return True


class PrivateHooks:
    """Put before `PreTrainedModel` in a model base class's bases; the class defines `keep_own_plan_rules(plans)`,
    `load_guarded(checkpoint_files, source, subfolder, load)` and `weight_loading_quantizer(hf_quantizer)`."""

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # Transformers decides by looking for `@use_experts_implementation` in the model's source file; ours read
        # `config._experts_implementation` in `Experts` (hf_ppmoe.moe.experts) instead
        return True

    def _resolve_parallel_plans(self, distributed_config):
        return self.keep_own_plan_rules(super()._resolve_parallel_plans(distributed_config))

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, expected_keys=None):
        from transformers import PreTrainedModel

        if load_config.hf_quantizer is not None:  # Transformers' quantizer, taught the model's own quantized weights
            quantizer = model.weight_loading_quantizer(load_config.hf_quantizer)
            load_config = dataclasses.replace(load_config, hf_quantizer=quantizer)

        def load():
            return PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files, load_config, expected_keys)

        subfolder = (load_config.download_kwargs or {}).get("subfolder") or ""
        return model.load_guarded(checkpoint_files, load_config.pretrained_model_name_or_path, subfolder, load)


def resolve_parallel_plans(model: PreTrainedModel, distributed_config) -> tuple:
    """(tp plan, ep plan, ...) as `from_pretrained(distributed_config=...)` resolves them for `model`."""
    return model._resolve_parallel_plans(distributed_config)


def restrict_instance_plans(model: PreTrainedModel, keep: Callable[[str], bool]) -> None:
    """Keeps the rules of the model's merged tp / ep plans whose key `keep` accepts."""
    model._tp_plan = {key: style for key, style in model._tp_plan.items() if keep(key)}
    model._ep_plan = {key: style for key, style in model._ep_plan.items() if keep(key)}


def record_split(model: PreTrainedModel, distributed_config, mesh, tp_size: int) -> None:
    """What `from_pretrained(distributed_config=...)` records on a split model, so `save_pretrained` gathers it."""
    model.config.distributed_config, model._device_mesh, model._tp_size = distributed_config, mesh, tp_size


def device_mesh_of(model: PreTrainedModel):
    """The mesh the model was split over (`record_split`, or `from_pretrained(distributed_config=...)`), else None."""
    return getattr(model, "_device_mesh", None)


def is_first_pipeline_stage(model: PreTrainedModel) -> bool:
    """Under Transformers' pipeline parallelism: whether this rank holds the model's first stage."""
    return model._pp_stage.pp_is_first_stage


def register_output_recorders(module: nn.Module, recorders: dict) -> None:
    """Where Transformers' output hooks look a module's recorders up (`PreTrainedModel.__init__` does the same)."""
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    _CAN_RECORD_REGISTRY[module] = recorders


def attention_implementation(config) -> str:
    """The attention implementation a model was built or set with ("eager", "sdpa", ...)."""
    return config._attn_implementation


def mark_expert_parallel(module: nn.Module) -> None:
    """Tells Transformers' expert-parallel code that `module` holds the experts of an expert-parallel layer."""
    module._is_expert_parallel = True


def expose_on_transformers(*classes: type) -> None:
    """Puts `classes` on the `transformers` module under their names: `transformers serve`'s model manager loads a
    checkpoint with `getattr(transformers, config.architectures[0])`, which finds only Transformers' own classes.
    Set on the module object its model manager holds and on the one in `sys.modules`: importing some Transformers
    modules (`transformers.modeling_layers`, in 5.24) puts a new `transformers` module object in `sys.modules`, so
    the two can differ."""
    import sys

    from transformers.cli.serving import model_manager

    modules = {id(m): m for m in (sys.modules["transformers"], model_manager.transformers)}
    for module in modules.values():
        for cls in classes:
            setattr(module, cls.__name__, cls)
