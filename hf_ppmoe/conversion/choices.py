"""The names and sizes the converters accept, in one light module (the standard library only): `hf-ppmoe upcycle|merge|export
--help` lists them, and their argument errors print, before torch is imported."""

import difflib
import math
import sys

# "auto": the router that keeps the dense model's logits exact and lets the experts grow apart: "random" for a gate
# whose combine weights sum to one for any router, "zeros" for the others (upcycling.resolve_router_init)
ROUTER_INITS = ("auto", "zeros", "random", "hidden")
# the built-in gates of hf_ppmoe.moe.gates (tests/conversion/test_cli.py holds the two equal), for the commands' checks
# before torch is imported; a gate registered in Python is checked by the model config
BUILTIN_GATES = ("topk", "switch", "gshard", "prototype")
MERGE_METHODS = ("mean", "usage", "expert")
# export targets: model_type -> Transformers class (export.TARGETS adds how each one is checked, configured and mapped)
EXPORT_CLASSES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "switch_transformers": "SwitchTransformersForConditionalGeneration",
}


def default_experts_per_token(router_type: str, num_experts_per_tok: int | None) -> int:
    """Routes per token when none is given: 1 for the switch gate, else 2."""
    if num_experts_per_tok is not None:
        return num_experts_per_tok
    return 1 if router_type == "switch" else 2


def routing_problem(router_type: str, num_experts: int, num_experts_per_tok: int | None) -> str | None:
    """What the model config would refuse about a command's --router_type, --num_experts and --num_experts_per_tok
    (None: the gate's default), in the command's words, or None. The rules of the built-in gates (their
    `check_config`; a test holds the two in agreement)."""
    E, given = num_experts, num_experts_per_tok is not None
    registered = getattr(sys.modules.get("hf_ppmoe.moe.gates"), "GATES", {})  # gates of the user's own, if any
    if router_type not in BUILTIN_GATES and router_type in registered:
        return None  # its rules are its own: the model config checks them
    if router_type not in BUILTIN_GATES:
        close = difflib.get_close_matches(router_type, BUILTIN_GATES, n=1)
        hint = f"; did you mean --router_type {close[0]}?" if close else "."
        return f"--router_type {router_type}: no such gate; use one of {', '.join(BUILTIN_GATES)}{hint}"
    k = default_experts_per_token(router_type, num_experts_per_tok)
    flag = f"--num_experts_per_tok {k}" + ("" if given else " (the default)")
    if k < 1:
        return f"--num_experts_per_tok {k}: a token takes at least 1 expert; give 1 or more."
    if k > E:
        return (f"{flag} is more than --num_experts {E}: a token cannot take more experts than there are; lower "
                "--num_experts_per_tok or raise --num_experts.")
    if router_type == "switch" and k != 1:
        return f"--router_type switch routes each token to 1 expert, not {flag}; drop --num_experts_per_tok, or use --router_type topk."
    if router_type == "gshard" and k != 2:
        return f"--router_type gshard is GShard's top-2 gating, not {flag}; drop --num_experts_per_tok, or use --router_type topk."
    if router_type == "prototype" and E % k:
        return (f"--router_type prototype splits --num_experts {E} into {flag} prototypes, which must divide it; "
                f"use --num_experts_per_tok among {[d for d in range(1, E + 1) if E % d == 0]}.")
    return None


def granularity_problem(granularity, num_experts: int, copies_per_token: int, router_type: str, router_init: str,
                        reinit_ratio: float) -> str | None:
    """What keeps fine-grained upcycling (`granularity` g > 1) from giving the dense model's logits, in words naming
    the fix, or None. The experts are num_experts / g copies of the FFN in g slices; a token takes
    copies_per_token * g of them, whole copies when the router's rows are equal within each copy."""
    g, E, k = granularity, num_experts, copies_per_token
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        return f"granularity={g!r}: a positive integer (1, the default: every expert is a whole copy of the FFN)."
    if g == 1:
        return None
    if E % g:
        return (f"granularity={g} must divide num_experts={E}: the experts are num_experts / granularity copies of "
                f"the FFN, each in {g} slices; use a multiple of {g}.")
    if k * g > E:
        return (f"num_experts_per_tok={k} copies per token take {k} * granularity = {k * g} experts, more than "
                f"num_experts={E}; lower num_experts_per_tok or raise num_experts.")
    if router_type != "topk":
        return (f"granularity={g} needs router_type='topk', not {router_type!r}: switch and gshard route a fixed 1 or "
                "2 experts per token and drop routes past capacity slice by slice, prototype routes within "
                "prototypes, so a token would not take the slices of a copy together.")
    if router_init == "zeros":
        return (f"granularity={g} with router_init='zeros': every expert scores the same, so which {k * g} experts a "
                "token takes depends on torch.topk's order among ties, not whole copies of the FFN; use "
                "router_init='random' or 'hidden' (router rows equal within each copy: exact with norm_topk_prob=True).")
    if reinit_ratio:
        return (f"granularity={g} with reinit_ratio={reinit_ratio}: Drop-Upcycling of sliced experts is not built; "
                "use one of the two (granularity=1, or reinit_ratio=0).")
    return None


def parse_size(size: int | str) -> int:
    """5000000, "5GB", "500MB", "2GiB" -> bytes."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    unit = next((u for u in units if text.endswith(u)), "")
    try:
        number = float(text[: len(text) - len(unit)])
    except ValueError:
        number = math.nan
    if not number > 0 or math.isinf(number):
        raise ValueError(f"max_shard_size {size!r}: give a size such as 5GB, 500MB or 2GiB, or a number of bytes.")
    return int(number * units.get(unit, 1))
