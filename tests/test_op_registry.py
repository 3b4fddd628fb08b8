"""Every `hf_ppmoe::` custom op has each dispatch key registered once (issue 29).

torch 2.11 refuses a second registration of a key that Python already holds (`register_kernel("meta", ...)` on an
op that has `register_fake`: "This is not allowed since there's already a kernel registered from python ..."), so
`import hf_ppmoe` failed there; torch 2.13 lets the second one override the first without a word, so CI on 2.13 saw
nothing. This test sees it on any torch: it imports every module of the package and reads the dispatcher's own
table (`torch._C._dispatch_dump`, which lists an overridden kernel again, marked "(inactive)") and torch.library's
bookkeeping of custom ops (`register_fake` installs the Meta kernel, so a `register_kernel("meta")` beside it is a
second one). The toy op below shows that the check finds exactly that defect.
"""

import importlib
import pkgutil
import re
from collections import Counter

import pytest
import torch
from torch._library import custom_ops

import hf_ppmoe

NAMESPACE = "hf_ppmoe"


def import_every_module(package=hf_ppmoe):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)


def double_registrations(op_name: str) -> list[str]:
    """'op: key registered N times' for every dispatch key of `op_name` that holds more than one kernel, counted in
    the dispatcher's table and in torch.library's custom-op bookkeeping."""
    found = []
    keys = Counter(re.sub(r" \(inactive\)$", "", line.split(":", 1)[0])
                   for line in torch._C._dispatch_dump(op_name).splitlines()[4:] if ": registered at" in line)
    found += [f"{op_name}: dispatch key {key} registered {n} times" for key, n in keys.items() if n > 1]
    opdef = custom_ops.OPDEFS.get(op_name)
    if opdef is not None and opdef._abstract_fn is not None and "meta" in opdef._backend_fns:
        found.append(f"{op_name}: register_fake and register_kernel('meta') both give the Meta kernel")
    return sorted(set(found))


def our_ops():
    import_every_module()
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(NAMESPACE + "::"))


def test_the_check_finds_a_meta_kernel_registered_beside_register_fake():
    """A test-only op with register_fake and then register_kernel("meta"): torch 2.11 refuses the second
    registration, torch 2.13 takes it; either way the defect is seen (by torch or by the check)."""

    @torch.library.custom_op("hf_ppmoe_test_registry::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @twice.register_fake
    def _(x):
        return torch.empty_like(x)

    assert double_registrations("hf_ppmoe_test_registry::twice") == []  # one registration per key: clean
    try:
        twice.register_kernel("meta", lambda x: torch.empty_like(x))
    except RuntimeError as refused:  # torch 2.11
        assert "already a kernel registered from python" in str(refused)
        return
    found = double_registrations("hf_ppmoe_test_registry::twice")
    assert any("Meta" in f for f in found), found


def test_every_hf_ppmoe_op_registers_each_dispatch_key_once():
    ops = our_ops()
    assert ops, f"no {NAMESPACE}:: op registered after importing every module (the check would test nothing)"
    found = [f for op in ops for f in double_registrations(op)]
    assert not found, ("a custom op's dispatch key is registered twice (torch 2.11 refuses this at import; 2.13 "
                       "overrides silently). Keep one registration per key, e.g. drop register_kernel('meta', ...) "
                       "where register_fake already gives the Meta kernel:\n  " + "\n  ".join(found))


@pytest.mark.parametrize("op", ["hf_ppmoe::grouped_mm_loop", "hf_ppmoe::grouped_mm_loop_backward"])
def test_the_ops_the_experts_use_are_registered(op):
    assert op in our_ops()
