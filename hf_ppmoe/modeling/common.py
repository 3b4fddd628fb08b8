"""`MoEPreTrainedModel`, the base of both model families: MoE weight init, active-parameter count, and a guarded,
self-contained `save_pretrained` / `from_pretrained`. Saving replaces the folder in one step, writes the code for
`trust_remote_code=True` (`hub_io`) and records the weights' SHA-256; loading refuses weight files outside the folder,
changed checksums, integer tensors for floating-point weights, NaN or infinity (hf_ppmoe/utils), and a checkpoint
without this model's router and expert tensors. Transformers' parallel hooks are the mixin `ParallelHooks`.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..moe.experts import EXPERTS_IMPLEMENTATIONS, Experts
from ..moe.gates import Gate
from ..moe.layer import MoELayer
from ..moe.quantized import parameter_count
from ..utils.atomic import atomic_folder
from ..utils.integrity import (
    WEIGHT_FILE,
    check_finite,
    check_inside,
    check_stored_dtypes,
    stored_dtypes,
    verify_checksums,
    write_checksums,
)
from ..utils.transformers_private import PrivateHooks
from .hub_io import add_remote_code, check_moe_tensors_loaded, write_custom_generate
from .parallel_hooks import ParallelHooks
from .quantization import dequantize_model_experts, weight_loading_quantizer


def layer_outputs(hidden_states: torch.Tensor, routing) -> tuple:
    """A layer's outputs: (hidden_states, aux_loss, z_loss), the losses None without a `Routing` or when they were
    not computed. Top-level tensors, because reentrant gradient checkpointing (`use_reentrant=True`, what PEFT's
    k-bit preparation asks for) runs the layer without autograd and gives gradients only to the tensors the layer
    returns directly."""
    if routing is None:
        return hidden_states, None, None
    return hidden_states, routing.aux_loss, routing.z_loss


# from_pretrained(..., verify_checksums=False) reaches load_guarded through this
_VERIFY_CHECKSUMS = contextvars.ContextVar("verify_checksums", default=True)


class MoEPreTrainedModel(ParallelHooks, PrivateHooks, PreTrainedModel):
    """Base of both families: MoE weight init and an all-or-nothing, self-contained `save_pretrained`."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _skip_keys_device_placement = ["cache"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # {"AutoModelForCausalLM": "GPTMoEForCausalLM", ...}: Auto classes written into the saved config's auto_map
    _auto_classes: dict[str, str] = {}

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """Transformers' check of an `experts_implementation`, which also takes ours ("index", "einsum": they run on
        our `Experts` only, so Transformers' global registry does not list them) and makes "index" the default
        (Transformers' default is "grouped_mm")."""
        requested = "index" if requested_experts is None else requested_experts
        if requested in EXPERTS_IMPLEMENTATIONS:
            return requested
        try:
            return super().get_correct_experts_implementation(requested)
        except ValueError as error:
            raise ValueError(f"{error} Our models also take {', '.join(map(repr, EXPERTS_IMPLEMENTATIONS))}.") from None

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Transformers' former name of `is_activation_checkpointing` (deprecated in 5.x), which PEFT still reads when
        it wraps a model (`get_peft_model`, `PeftModel.from_pretrained`): the same answer, without the FutureWarning
        addressed to PEFT's code that it printed to our users."""
        return self.is_activation_checkpointing

    def num_active_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameters that take part in one token's forward pass, the number MoE models are compared by: all of them,
        less the routed experts a token does not reach (each MoE layer runs k of its E experts; a shared expert and the
        router always run). `num_parameters()` gives the total."""
        inactive = 0
        for module in self.modules():
            if isinstance(module, MoELayer):
                E, k = module.experts.num_experts, module.gate.top_k
                inactive += parameter_count(module.experts) * (E - k) // E
        return self.num_parameters(exclude_embeddings=exclude_embeddings) - inactive

    def weight_loading_quantizer(self, hf_quantizer):
        """The quantizer the weights load with under `from_pretrained(..., quantization_config=...)`: Transformers'
        bitsandbytes quantizer, which also stores every expert weight quantized (hf_ppmoe.modeling.quantization);
        a config that would leave the experts in full precision is refused."""
        return weight_loading_quantizer(self, hf_quantizer)

    def dequantize(self, dtype: torch.dtype | None = None):
        """Transformers' `dequantize` (quantized linear layers back to `nn.Linear`), the experts' quantized weights
        back to plain parameters too (in `dtype`, by default the model's): e.g. to merge a QLoRA adapter."""
        dequantize_model_experts(self, dtype or self.config.dtype)
        return super().dequantize(dtype=dtype)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, (Experts, Gate)):
            module.reset_parameters()

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        """Transformers' `save_pretrained` into a temporary folder that then replaces `save_directory` in one step
        (hf_ppmoe.utils.atomic: a failed or killed save leaves the previous folder as it was; files of the folder
        that this save does not write, e.g. a tokenizer, are kept, earlier weight files are not), plus the code for
        `trust_remote_code=True` and the weights' SHA-256 in `checksums.sha256`. In a multi-process run only rank 0
        writes; the other ranks take part in gathering split weights."""
        if not self.should_save_on_this_rank(is_main_process):
            return super().save_pretrained(save_directory, *args, is_main_process=False, **kwargs)
        target = Path(save_directory)
        if target.is_file():
            raise ValueError(f"save_pretrained needs a directory, but {target} is a file.")
        if kwargs.get("push_to_hub") and not kwargs.get("repo_id"):
            kwargs["repo_id"] = target.name
        with atomic_folder(target, overwrite=True, keep=lambda entry: not WEIGHT_FILE.match(entry.name)) as staging:
            add_remote_code(staging, type(self), self.config)
            write_custom_generate(staging)
            result = super().save_pretrained(staging, *args, **kwargs)
            write_checksums(staging, [p.name for p in staging.iterdir() if WEIGHT_FILE.match(p.name)])
        return result

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path, *args, verify_checksums: bool = True, strict_moe: bool = True, **kwargs
    ):
        """Transformers' `from_pretrained`, with the checks of `load_guarded`. `verify_checksums=False`
        skips comparing the weight files with `checksums.sha256` (which reads every byte once more).

        A router or expert tensor that the checkpoint lacks, or holds beyond the model's, is an error naming the
        tensors (`check_moe_tensors_loaded`): Transformers would initialise it anew (or drop it) with a load report
        only, which for an MoE is another model. `strict_moe=False`, or `output_loading_info=True` (the caller then
        reads the report), keeps Transformers' behaviour."""
        wants_info = kwargs.pop("output_loading_info", False)
        token = _VERIFY_CHECKSUMS.set(verify_checksums)
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs
            )
        finally:
            _VERIFY_CHECKSUMS.reset(token)
        if strict_moe and not wants_info:
            check_moe_tensors_loaded(model, info, pretrained_model_name_or_path)
        return (model, info) if wants_info else model

    def load_guarded(self, checkpoint_files, source, subfolder: str, load: Callable):
        """Transformers' loading of the weights (`load`, through `PrivateHooks`), guarded: every weight file must lie
        inside a local checkpoint's folder (no `../`, absolute names or symlinks out of it in the shard index), match
        `checksums.sha256` when the folder has one, and hold no integer tensor where the model has a floating-point
        one; the loaded weights must be finite."""
        model = self
        files, stored = [Path(f) for f in checkpoint_files or [] if f is not None], {}
        if files:
            local = source is not None and os.path.isdir(source)
            # a Hub repository's file names were checked by huggingface_hub; its files live in one snapshot folder
            folder = Path(source, subfolder) if local else files[0].parent
            names = [os.path.relpath(f, folder) for f in files]
            if local:
                check_inside(folder, names, "weight file")
            if _VERIFY_CHECKSUMS.get():
                verify_checksums(folder, names)
            stored = stored_dtypes(f for f in files if f.suffix == ".safetensors")
            check_stored_dtypes(stored, model.state_dict(keep_vars=True))
        result = load()
        check_finite((stored[name][0], name, t) for name, t in model.state_dict().items() if name in stored)
        return result


