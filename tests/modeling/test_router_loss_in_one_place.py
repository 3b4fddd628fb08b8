"""The router term of the loss (coefficient times aux loss plus coefficient times z loss) is written once, in
`hf_ppmoe.moe.losses.router_loss`: no other module of the package multiplies by a router loss coefficient (the
Megatron-LM plugin scales the coefficients per layer for megatron-core's own loss, which is not this sum)."""

import re
from pathlib import Path

import hf_ppmoe

PACKAGE = Path(hf_ppmoe.__file__).parent
# a coefficient in a product: `router_aux_loss_coef * aux`, `aux * config.router_z_loss_coef`, `aux_coef * aux`, ...
PRODUCT = re.compile(r"\b\w*(aux|z)\w*_coef\w*\s*\*|\*\s*[\w.]*\b\w*(aux|z)\w*_coef\b")


def test_router_loss_formula_is_only_in_moe_losses():
    sources = [p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "megatron" / "plugin.py"]
    assert PACKAGE / "moe" / "losses.py" in sources
    places = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in sources
        if path.name != "losses.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRODUCT.search(line)
    ]
    assert not places, "the router-loss sum written outside moe/losses.py (use router_loss):\n" + "\n".join(places)
    assert PRODUCT.search((PACKAGE / "moe" / "losses.py").read_text())  # the pattern finds the one place


# a subtraction whose right-hand side holds a router loss: `loss - weight * router_loss(...)`, `lm - coef * aux_loss`
SUBTRACTION = re.compile(r"\s-\s[^#\n]*\b(router_loss|router_loss_weight|\w*aux_loss|\w*z_loss)\b")


def test_no_consumer_subtracts_the_router_term():
    """The model outputs carry `lm_loss` and `num_target_tokens` beside `loss` (`hf_ppmoe.modeling.loss`): no module of
    the package or the benchmarks gets the LM loss back by subtracting the router term."""
    sources = [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "benchmarks").rglob("*.py")]
    places = [
        f"{path}:{number}: {line.strip()}"
        for path in sources
        if path != PACKAGE / "megatron" / "plugin.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if SUBTRACTION.search(line.split("#")[0])
    ]
    assert not places, "the LM loss recovered by subtracting the router term (read `lm_loss`):\n" + "\n".join(places)
    assert SUBTRACTION.search("    lm = out.loss.detach() - weight * router_loss(run.config, aux, z)")
