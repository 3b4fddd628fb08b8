"""The megatron-core GPTModel built from our config reproduces GPTMoEForCausalLM: logits, every gradient, and the
losses GPTMoETrainStep reports, with experts on the TP group (TP = EP = 2, sequence parallel), with PP = 2, and with
TP = 1 (DP = 2).

Every test body runs on 2 CPU processes (gloo) in one launch of its own (tests/distributed.py, group "megatron"), so
the CPU patches of megatron_cpu.py stay in those processes; importing megatron-core costs ~20 s per process. Weights
reach Megatron through `hf_ppmoe.megatron.weights` (strict `load_state_dict`, so names and shapes must
be exactly what megatron-core builds) and come back through it. Differences are float32's: below 2e-7 measured.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import tmp_dir
from helpers import GPT2_STYLE, tiny_gpt_config
from megatron_cpu import MEGATRON_CORE_VERSION


def _missing() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("megatron-core")
    except PackageNotFoundError:
        return 'needs megatron-core (pip install -e ".[megatron]")'
    if found != MEGATRON_CORE_VERSION:
        return (
            f"the CPU patches in megatron_cpu.py are written for megatron-core {MEGATRON_CORE_VERSION}, found {found}"
        )
    return None


pytestmark = [pytest.mark.skipif(_missing() is not None, reason=_missing() or ""), pytest.mark.distributed(2, group="megatron")]

# every config uses all four MoE-relevant mappings once: gates, biases, positions, norms, tying, dense/MoE mixing
CONFIGS = {
    # GQA, SwiGLU, RMSNorm, RoPE, Qwen3's per-head q/k norm (qk_layernorm), untied, top-2 renormalised, every FFN MoE,
    # aux and z losses
    "llama": dict(qk_norm=True, router_aux_loss_coef=0.02, router_z_loss_coef=0.01),
    # learned positions, LayerNorm, biases everywhere (experts too), tied embeddings, tanh GELU, Switch top-1
    "gpt2": dict(GPT2_STYLE, router_type="switch", num_experts_per_tok=1, router_z_loss_coef=0.01),
    # q/k/v bias only, top-2 without renormalisation, a dense first layer, a shared expert, sliding window
    "qwen": dict(
        attention_bias=True,
        attention_output_bias=False,
        norm_topk_prob=False,
        moe_layer_frequency=2,
        shared_expert_intermediate_size=32,
        sliding_window=4,
    ),
}
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp1": (1, 1)}  # (TP = EP, PP) over the 2 processes
B, S = 2, 8
TOLERANCE = 1e-5  # float32


_layout = None


def initialize(layout: str) -> None:
    """megatron-core's parallel state for `layout` (kept while the following tests use the same one)."""
    global _layout
    import megatron_cpu
    from megatron.core import parallel_state as ps

    if _layout == layout:
        return
    megatron_cpu.apply()
    tp, pp = LAYOUTS[layout]
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=tp,
        expert_tensor_parallel_size=1,
    )
    megatron_cpu.seed(1234)
    _layout = layout


def config(name, **overrides):
    return tiny_gpt_config(**{**CONFIGS[name], **overrides})


def hf_model(cfg, seed=0):
    from hf_ppmoe import GPTMoEForCausalLM

    torch.manual_seed(seed)
    return GPTMoEForCausalLM(cfg)


def inputs(cfg, seed=1):
    return torch.randint(3, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))


def ranks():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()


def build(cfg, divisible_by=128):
    from megatron.core import parallel_state as ps

    from hf_ppmoe.megatron.plugin import model_provider

    provider = model_provider(cfg, make_vocab_size_divisible_by=divisible_by, use_cpu_initialization=True)
    return provider(pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())


def load(model, hf_state_dict, cfg, divisible_by=128):
    from hf_ppmoe.megatron.weights import to_megatron

    tp, pp = model.config.tensor_model_parallel_size, model.config.pipeline_model_parallel_size
    shards = to_megatron(hf_state_dict, cfg, tp=tp, pp=pp, make_vocab_size_divisible_by=divisible_by)
    model.load_state_dict(shards[ranks()], strict=True)
    return model


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def logits(model, ids):
    pos = torch.arange(S).expand(B, S)
    with torch.no_grad():
        return model(ids, pos, None, runtime_gather_output=True)


def gather_state_dicts(model):
    """{(tp_rank, pp_rank): state dict} of every rank (what a Megatron-LM save would write)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ranks(), model.state_dict()))
    return dict(gathered)


def run_schedule(model, batch, forward_step, forward_only):
    import megatron_cpu
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()
    with megatron_cpu.CudaToCpuMode():
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([batch]),
            model=[model],
            num_microbatches=1,
            seq_length=S,
            micro_batch_size=B,
            forward_only=forward_only,
        )


def finish_grads(model):
    """What megatron-core's finalize_model_grads does for a DDP-wrapped model: sum the gradients of parameters tagged
    `sequence_parallel` over the TP group (norms; with megatron_cpu's norm the q/k norms of qk_layernorm are tagged too,
    which finalize_model_grads sums by name), and the tied embedding's over the first and last pipeline stage."""
    from megatron.core import parallel_state as ps

    for p in model.parameters():
        if (
            p.grad is not None
            and getattr(p, "sequence_parallel", False)
            and ps.get_tensor_model_parallel_world_size() > 1
        ):
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    if model.share_embeddings_and_output_weights and ps.get_pipeline_model_parallel_world_size() > 1:
        weight = model.shared_embedding_or_output_weight()
        dist.all_reduce(weight.grad, group=ps.get_embedding_group())


# the tests are ordered by layout: each layout is set up once


@pytest.mark.parametrize("layout", ["tp2", "tp1"])
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_both_ways(layout, name):
    """Our weights in Megatron's model: Megatron's logits = ours. Megatron's own (random) weights converted to our
    model: our logits = Megatron's."""
    from hf_ppmoe.megatron.weights import from_megatron

    initialize(layout)
    cfg = config(name)
    hf = hf_model(cfg).eval()
    ids = inputs(cfg)
    model = load(build(cfg), hf.state_dict(), cfg).eval()
    with torch.no_grad():
        expected = hf(ids).logits
    assert max_diff(logits(model, ids)[..., : cfg.vocab_size], expected) <= TOLERANCE

    torch.manual_seed(5)
    import megatron_cpu

    megatron_cpu.seed(5)
    fresh = build(cfg).eval()
    shards = gather_state_dicts(fresh)
    back = hf_model(cfg)
    back.load_state_dict(from_megatron(shards, cfg, tp=fresh.config.tensor_model_parallel_size, pp=1), strict=True)
    with torch.no_grad():
        assert max_diff(logits(fresh, ids)[..., : cfg.vocab_size], back.eval()(ids).logits) <= TOLERANCE


def test_megatron_lm_loads_the_converted_checkpoint():
    """Megatron-LM's loader on our converted files (TP = EP = 2): file name from the parallel ranks, plain torch.load,
    strict load_state_dict; then the logits are ours."""
    from megatron.core import parallel_state as ps

    from hf_ppmoe.megatron.weights import checkpoint_args, save_megatron_checkpoint, to_megatron

    initialize("tp2")
    cfg = config("llama")
    hf = hf_model(cfg).eval()
    root = Path(tmp_dir()) / "megatron"
    if dist.get_rank() == 0:
        save_megatron_checkpoint(to_megatron(hf.state_dict(), cfg, tp=2), root, checkpoint_args(cfg, tp=2, pp=1))
    dist.barrier()
    tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    state = torch.load(root / "release" / f"mp_rank_{tp_rank:02d}_{ep_rank:03d}" / "model_optim_rng.pt",
                       map_location="cpu", weights_only=False)
    model = build(cfg).eval()
    model.load_state_dict(state["model"], strict=True)
    assert state["args"].padded_vocab_size == model.vocab_size and state["checkpoint_version"] == 3.0
    ids = inputs(cfg)
    with torch.no_grad():
        assert max_diff(logits(model, ids)[..., : cfg.vocab_size], hf(ids).logits) <= TOLERANCE


def test_padded_evaluation_loss():
    """A right-padded batch through GPTMoETrainStep (evaluation, TP = EP = 2): Megatron's LM loss = ours, padding
    ignored."""
    from megatron.core import parallel_state as ps

    from hf_ppmoe.megatron.plugin import GPTMoETrainStep

    initialize("tp2")
    cfg = config("llama", vocab_size=96)
    hf = hf_model(cfg).eval()
    ids = inputs(cfg)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        lg = hf(ids, attention_mask=mask).logits
    expected = F.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    model = load(build(cfg, divisible_by=1), hf.state_dict(), cfg, divisible_by=1).eval()
    step = GPTMoETrainStep(SimpleNamespace(model_return_dict=False), config=cfg)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    reported = run_schedule(model, batch, step.forward_step, forward_only=True)
    assert ps.is_pipeline_last_stage()
    assert abs(reported[0]["lm loss"].item() - expected.item()) <= TOLERANCE


@pytest.mark.parametrize(
    "layout, name", [("tp2", "llama"), ("tp2", "gpt2"), ("pp2", "llama"), ("pp2", "gpt2"), ("tp1", "gpt2")]
)
def test_train_step_gradients_and_losses(layout, name):
    """GPTMoETrainStep in megatron-core's schedule vs our loss.backward(): every parameter's gradient on every rank,
    and the losses the last stage reports (LM, aux, z, their sum = our loss; with PP = 2 the last stage cannot see
    earlier stages' router losses and reports the LM loss only)."""
    from megatron.core import parallel_state as ps

    from hf_ppmoe.megatron.weights import to_megatron
    from hf_ppmoe.moe.losses import router_loss
    from hf_ppmoe.megatron.plugin import GPTMoETrainStep

    initialize(layout)
    cfg = config(name, vocab_size=96)  # no vocabulary padding: padded logits would join Megatron's softmax
    hf = hf_model(cfg).train()
    ids = inputs(cfg)
    out = hf(ids, labels=ids)
    out.loss.backward()
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    model = load(build(cfg, divisible_by=1), hf.state_dict(), cfg, divisible_by=1).train()
    step = GPTMoETrainStep(SimpleNamespace(model_return_dict=False), config=cfg)
    reported = run_schedule(model, {"input_ids": ids}, step.forward_step, forward_only=False)
    finish_grads(model)

    hf_grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in hf.named_parameters()}
    expected = to_megatron(hf_grads, cfg, tp=tp, pp=pp, make_vocab_size_divisible_by=1)[ranks()]
    params = dict(model.named_parameters())
    assert set(params) == {k for k, v in expected.items() if v is not None}, set(params) ^ set(expected)
    worst = max(params, key=lambda k: max_diff(params[k].grad, expected[k]))
    assert max_diff(params[worst].grad, expected[worst]) <= TOLERANCE, worst
    if not ps.is_pipeline_last_stage():
        return
    (losses,) = reported
    lm_loss = out.loss - router_loss(cfg, out.aux_loss, out.z_loss)
    assert abs(losses["lm loss"].item() - lm_loss.item()) <= TOLERANCE
    if pp > 1:
        assert set(losses) == {"lm loss"}
        return
    assert abs(losses["aux loss"].item() - cfg.router_aux_loss_coef * out.aux_loss.item()) <= TOLERANCE
    assert abs(losses["z loss"].item() - cfg.router_z_loss_coef * out.z_loss.item()) <= TOLERANCE
    assert abs(sum(v.item() for v in losses.values()) - out.loss.item()) <= TOLERANCE


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_pipeline_logits(name):
    """Logits out of the last stage of a forward-only pipeline schedule (PP = 2)."""
    from megatron.core import parallel_state as ps

    initialize("pp2")
    cfg = config(name)
    hf = hf_model(cfg).eval()
    ids = inputs(cfg)
    model = load(build(cfg), hf.state_dict(), cfg).eval()

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)["input_ids"]
        output = model(tokens, torch.arange(S).expand(B, S), None)
        return output, lambda out: (out.sum() * 0, {"logits": out.detach()})

    reported = run_schedule(model, {"input_ids": ids}, forward_step, forward_only=True)
    if ps.is_pipeline_last_stage():
        with torch.no_grad():
            expected = hf(ids).logits
        assert max_diff(reported[0]["logits"][..., : cfg.vocab_size], expected) <= TOLERANCE
