"""Multi-process checks, run by `launch.run_job` under torchrun (gloo, CPU, OMP_NUM_THREADS=1):

    python -m torch.distributed.run --nproc-per-node N tests/parallel/worker.py JOB OUT_DIR

Every check of JOB runs on every rank, in order, and returns numbers (differences to the single-process model,
collective counts, error messages); each rank writes them to OUT_DIR/rank{r}.json after every check. The tests
(test_*.py in this folder) assert on them. Process start-up is the expensive part, so one job holds many checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # the Trainer check runs the example's code
from helpers import GPT2_STYLE, tiny_gpt_config, tiny_seq2seq_config  # noqa: E402

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration  # noqa: E402
from hf_ppmoe.modeling.common import router_loss_weight  # noqa: E402
from hf_ppmoe.parallel import Pipeline, count_collectives, init_distributed, make_mesh, parallelize  # noqa: E402
from hf_ppmoe.parallel.modules import ExpertParallel  # noqa: E402

JOBS: dict[str, list] = {"two": [], "four": []}
LLAMA = {}
QWEN3 = dict(qk_norm=True)  # Llama's layout plus per-head q/k norms: replicated weights with partial gradients under TP
# the gates of the proof: capacity-limited, random routing, jitter, groups, padding; alternate the dense styles
GATES = {
    "gshard_random_capacity": dict(router_type="gshard", capacity_factor=1.0, router_num_groups=2, **QWEN3),
    "switch_jitter_capacity": dict(
        router_type="switch", num_experts_per_tok=1, capacity_factor=1.0, router_jitter_noise=0.1, **GPT2_STYLE
    ),
    "topk_capacity_shared": dict(router_type="topk", capacity_factor=0.5, shared_expert_intermediate_size=24),
    "topk_dropless_einsum": dict(router_type="topk", dispatch="einsum", **GPT2_STYLE),
    "prototype_capacity": dict(router_type="prototype", capacity_factor=0.75, shared_expert_intermediate_size=16),
}
# the same gates in the encoder-decoder, alternating T5 v1.1 (gated, untied) and v1.0 (ReLU, tied, rescaled head),
# all-MoE stacks and stacks with dense FFNs between the MoE layers
T5_V10 = dict(gated_mlp=False, hidden_act="relu", tie_word_embeddings=True, scale_decoder_outputs=True)
SEQ2SEQ_GATES = {
    "gshard_random_capacity": dict(router_type="gshard", capacity_factor=1.0, router_num_groups=2),
    "switch_jitter_capacity": dict(
        router_type="switch", num_experts_per_tok=1, capacity_factor=1.0, router_jitter_noise=0.1, **T5_V10
    ),
    "topk_capacity_shared": dict(
        router_type="topk", capacity_factor=0.5, shared_expert_intermediate_size=24, moe_layer_frequency=2
    ),
    "topk_dropless_einsum": dict(router_type="topk", dispatch="einsum", moe_layer_frequency=2, **T5_V10),
    "prototype_capacity": dict(router_type="prototype", capacity_factor=0.75, shared_expert_intermediate_size=16),
}
ATOL = 2e-6


def job(name):
    def register(fn):
        JOBS[name].append(fn)
        return fn

    return register


def gates(model):
    return [m for name, m in model.named_modules() if name.endswith("mlp.gate")]


def build(seed=0, seq2seq=False, **overrides):
    """The same model on every rank (same seed), with seeded router generators (jitter / random routing)."""
    torch.manual_seed(seed)
    if seq2seq:
        model = Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config(**overrides)).train()
    else:
        model = GPTMoEForCausalLM(tiny_gpt_config(**overrides)).train()
    for i, gate in enumerate(gates(model)):
        gate.generator = torch.Generator().manual_seed(100 + i)
    return model


def batch(seed=1, size=4, length=12, seq2seq=False):
    """(input_ids, attention_mask, labels): padded on both sides; an encoder-decoder's labels [size, 8] end in
    ignored (-100) positions of different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (size, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[-1, -4:] = 0  # right padding
    if not seq2seq:
        return ids, mask, ids.masked_fill(mask == 0, -100)
    labels = torch.randint(3, 97, (size, 8), generator=g)
    labels[0, -1:] = labels[-1, -3:] = -100
    return ids, mask, labels


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(model, ref, name_of=lambda n: n, what="grad"):
    """Largest |parallel - single-process| over the parameters (or their gradients); a collective (full_tensor)."""
    refs = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        ours, theirs = (p.grad, refs[name_of(name)].grad) if what == "grad" else (p, refs[name_of(name)])
        worst = max(worst, (full(ours) - theirs).abs().max().item())
    return worst


def replicated_spread(tensors, group=None):
    """Largest difference of a replicated tensor between this rank and the others (0 when bitwise equal)."""
    worst = 0.0
    for t in tensors:
        gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, t.contiguous(), group=group)
        worst = max(worst, max((g - t).abs().max().item() for g in gathered))
    return worst


def train_pair(model, ref, step_fn, steps=2):
    """Two optimizer steps on both models; per step the loss difference and the gradient difference."""
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (model, ref))
    out = []
    for step in range(steps):
        ids, mask, labels = batch(seed=step + 1, seq2seq=model.config.is_encoder_decoder)
        loss = step_fn(model, ids, mask, labels)
        ref_loss = step_fn(ref, ids, mask, labels)
        out.append({"loss": loss, "ref_loss": ref_loss, "grad": max_diff(model, ref)})
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return out


def lm_step(model, ids, mask, labels):
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.item()


# ---------------------------------------------------------------------------------------------- 2 ranks


@job("two")
def tp_ep_every_gate():
    """parallelize() (TP + PPMoE EP over 2 ranks) = single process, for every gate, through two optimizer steps."""
    results = {}
    families = [("gpt", GATES, {}), ("seq2seq", SEQ2SEQ_GATES, {"seq2seq": True})]
    for family, settings_per_gate, kind in families:
        for name, settings in settings_per_gate.items():
            ref = build(**kind, **settings)
            model = parallelize(build(**kind, **settings), dist.group.WORLD)
            steps = train_pair(model, ref, lm_step)
            experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
            results[f"{family}/{name}"] = {
                "steps": steps,
                "params_after": max_diff(model, ref, what="param"),
                "gate_spread": replicated_spread([gate.weight for gate in gates(model)]),
                "local_experts": sorted({e.num_experts for e in experts}),
                "expert_placement": sorted({str(e.down_proj.placements) for e in experts}),
            }
    return results


def save_checkpoint(settings, path, seq2seq=False):
    if dist.get_rank() == 0:
        build(seq2seq=seq2seq, **settings).save_pretrained(path)
    dist.barrier()


@job("two")
def transformers_entry_points():
    """The same split through Transformers: DistributedConfig(tp_size=2, ep_size=2, ep_implementation="ppmoe") on a
    built model and in from_pretrained, from_pretrained(distributed_config=DistributedConfig(tp_size=2)) (PPMoE from
    the tensor-parallel plan), from_pretrained(tp_plan="auto"), and Transformers' own all-reduce EP on our model; the
    encoder-decoder through the first, second and fourth."""
    from transformers import DistributedConfig

    ppmoe_ep = DistributedConfig(tp_size=2, ep_size=2, ep_implementation="ppmoe")
    ways = {
        "maybe_distribute_model_ep_ppmoe": ppmoe_ep,
        "from_pretrained_ep_ppmoe": ppmoe_ep,
        "from_pretrained_tp": DistributedConfig(tp_size=2),
        "from_pretrained_tp_plan_auto": "auto",
        "transformers_all_reduce_ep": DistributedConfig(tp_size=2, ep_size=2, ep_implementation="all_reduce"),
    }
    families = {
        "gpt": (GPTMoEForCausalLM, GATES["gshard_random_capacity"], list(ways)),
        "seq2seq": (
            Seq2SeqMoEForConditionalGeneration,
            SEQ2SEQ_GATES["switch_jitter_capacity"],
            ["maybe_distribute_model_ep_ppmoe", "from_pretrained_ep_ppmoe", "from_pretrained_tp_plan_auto"],
        ),
    }
    results = {}
    for family, (cls, settings, names) in families.items():
        seq2seq = family == "seq2seq"
        path = os.path.join(os.environ["PARALLEL_TEST_DIR"], f"checkpoint_{family}")
        save_checkpoint(settings, path, seq2seq)
        generators = [gate.generator.get_state() for gate in gates(build(seq2seq=seq2seq, **settings))]

        def reseed(model):  # a loaded model has no router generators: give it the reference's
            for gate, state in zip(gates(model), generators):
                gate.generator = torch.Generator()
                gate.generator.set_state(state)
            return model.train()

        for name in names:
            config = ways[name]
            if name.startswith("from_pretrained"):
                keyword = {"tp_plan": config} if config == "auto" else {"distributed_config": config}
                model = reseed(cls.from_pretrained(path, **keyword))
            else:
                config, _, mesh_manager = cls.prepare_distribute_model(config)
                model = cls.maybe_distribute_model(build(seq2seq=seq2seq, **settings), config, mesh_manager)
            ref = reseed(build(seq2seq=seq2seq, **settings))
            experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
            results[f"{family}/{name}"] = {
                "steps": train_pair(model.train(), ref, lm_step, steps=1),
                "ppmoe": all(isinstance(e, ExpertParallel) and e.parallel_style == "ppmoe" for e in experts),
                "local_experts": sorted({e.num_experts for e in experts}),
            }
    return results


@job("two")
def save_after_parallelize():
    """save_pretrained on every rank of a split model writes the whole model once; it loads in one process."""
    results = {}
    for family, cls, settings in [
        ("gpt", GPTMoEForCausalLM, GATES["topk_dropless_einsum"]),
        ("seq2seq", Seq2SeqMoEForConditionalGeneration, SEQ2SEQ_GATES["topk_dropless_einsum"]),  # tied head
    ]:
        path = os.path.join(os.environ["PARALLEL_TEST_DIR"], f"saved_split_{family}")
        model = parallelize(build(seq2seq=family == "seq2seq", **settings), dist.group.WORLD)
        lm_step(model, *batch(seq2seq=family == "seq2seq"))  # one step first: the saved weights are not the initial
        torch.optim.SGD(model.parameters(), lr=0.5).step()
        model.save_pretrained(path)
        dist.barrier()
        loaded = cls.from_pretrained(path)
        results[family] = {"params": max_diff(model, loaded, what="param"), "files": sorted(os.listdir(path))}
    return results


def collectives_of(run) -> dict:
    """[op, bytes] of every collective in run()'s forward and in the backward of its output's squared sum."""
    with count_collectives() as comm:
        y = run()
        comm.mark("backward")
        y.square().sum().backward()
    split = comm.marks["backward"]
    return {"forward": [[c.op, c.bytes] for c in comm.calls[:split]],
            "backward": [[c.op, c.bytes] for c in comm.calls[split:]]}


@job("two")
def communication_per_layer():
    """Collectives and bytes of one layer's forward and backward, per module: attention, dense FFN, MoE layer."""
    results = {}
    T, H = 2 * 8, 32
    for style_name, style in {"llama": LLAMA, "gpt2": GPT2_STYLE, "qwen3": QWEN3}.items():
        model = parallelize(build(moe_layer_frequency=2, **style), dist.group.WORLD)
        dense, moe = model.model.layers[0], model.model.layers[1]
        x = torch.randn(2, 8, H, requires_grad=True)
        positions = model.model.rotary_emb(x, torch.arange(8)[None]) if style_name != "gpt2" else None
        runs = {
            "attention": lambda: dense.self_attn(x, position_embeddings=positions, attention_mask=None)[0],
            "dense_ffn": lambda: dense.mlp(x),
            "moe_layer": lambda: moe.mlp(x)[0],
        }
        for name, run in runs.items():
            results[f"{style_name}/{name}"] = collectives_of(run)
    # the encoder-decoder's attention: the relative position bias looked up on this rank's heads (no communication),
    # cross-attention to an encoder output of S = 2 * 12 tokens
    model = parallelize(build(seq2seq=True), dist.group.WORLD)
    decoder = model.model.decoder
    x, encoder_out = torch.randn(2, 8, H, requires_grad=True), torch.randn(2, 12, H, requires_grad=True)
    runs = {
        "self_attention": lambda: decoder.layers[0].self_attn(
            x, attention_mask=None, position_bias=decoder.position_bias(8, 8, 0, x.device)
        )[0],
        "cross_attention": lambda: decoder.layers[0].cross_attn(x, attention_mask=None, key_value_states=encoder_out)[0],
    }
    for name, run in runs.items():
        results[f"seq2seq/{name}"] = collectives_of(run)
    results["sizes"] = {"T": T, "S": 2 * 12, "H": H, "E": 4, "head_dim": 8, "bytes_per_element": 4}
    return results


@job("two")
def pipeline_two_stages():
    """PP=2, GPipe and 1F1B: loss and gradients = single-process gradient accumulation, over two optimizer steps."""
    results = {}
    for schedule in ("gpipe", "1f1b"):
        for style_name, style in {"llama": LLAMA, "gpt2": GPT2_STYLE}.items():
            results[f"{schedule}/{style_name}"] = run_pipeline(schedule, style, dist.group.WORLD, None)
        # encoder | decoder: the encoder output alone crosses, the second stage starts the decoder
        results[f"{schedule}/seq2seq"] = run_pipeline(schedule, SEQ2SEQ_PIPELINE, dist.group.WORLD, None)
    return results


@job("two")
def ppmoe_on_transformers_moe():
    """DistributedConfig(tp_size=2, ep_size=2, ep_implementation="ppmoe") on Transformers' own Qwen3-MoE (its router
    outside the experts; normalised top-k weights or not) = one process through two optimizer steps."""
    from transformers import DistributedConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    results = {}
    for norm_topk_prob in (True, False):
        config = Qwen3MoeConfig(
            vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=norm_topk_prob, output_router_logits=True, router_aux_loss_coef=0.1, pad_token_id=0,
        )
        path = os.path.join(os.environ["PARALLEL_TEST_DIR"], f"qwen3_moe_{norm_topk_prob}")
        if dist.get_rank() == 0:
            torch.manual_seed(0)
            Qwen3MoeForCausalLM(config).save_pretrained(path)
        dist.barrier()
        ep = DistributedConfig(tp_size=2, ep_size=2, ep_implementation="ppmoe")
        model = Qwen3MoeForCausalLM.from_pretrained(path, distributed_config=ep).train()
        ref = Qwen3MoeForCausalLM.from_pretrained(path).train()
        experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
        results[f"norm_topk_prob={norm_topk_prob}"] = {
            "steps": train_pair(model, ref, lm_step),
            "params_after": max_diff(model, ref, what="param"),
            "local_experts": sorted({e.num_experts for e in experts}),
        }
    return results


@job("two")
def transformers_pipeline():
    """GPT-MoE under Transformers' own pipeline parallelism (from_pretrained(distributed_config=DistributedConfig(
    pp_size=2))), Llama and GPT-2 style: logits and greedy generation (left padding, KV cache) = one process; a
    training forward and an encoder-decoder are refused."""
    from transformers import DistributedConfig

    results, pp = {}, DistributedConfig(pp_size=2)
    ids, mask, _ = batch(size=3, length=7)
    mask[-1, -4:] = 1  # generation pads on the left only
    for style_name, style in {"llama": LLAMA, "gpt2": GPT2_STYLE}.items():
        settings = dict(num_hidden_layers=4, moe_layer_frequency=2, **style)
        path = os.path.join(os.environ["PARALLEL_TEST_DIR"], f"pp_{style_name}")
        save_checkpoint(settings, path)
        model = GPTMoEForCausalLM.from_pretrained(path, distributed_config=pp)
        ref = GPTMoEForCausalLM.from_pretrained(path)
        with torch.no_grad():
            logits = (model(input_ids=ids, attention_mask=mask).logits - ref(input_ids=ids, attention_mask=mask).logits)
        kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        results[style_name] = {
            "logits": logits.abs().max().item(),
            "generate_equal": torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw)),
            "layers_here": [i for i, layer in enumerate(model.model.layers) if hasattr(layer, "self_attn")],
        }
    try:
        model.train()(input_ids=ids, labels=ids)
    except RuntimeError as e:
        results["training"] = str(e)
    path = os.path.join(os.environ["PARALLEL_TEST_DIR"], "pp_seq2seq")
    save_checkpoint({}, path, seq2seq=True)
    try:
        Seq2SeqMoEForConditionalGeneration.from_pretrained(path, distributed_config=pp)
    except ValueError as e:
        results["seq2seq"] = str(e)
    return results


@contextlib.contextmanager
def accelerate_session():
    """Accelerate keeps process-wide state (its AcceleratorState, environment variables it sets, Transformers'
    DeepSpeed config): every check that uses it starts and leaves it clean."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    environment = dict(os.environ)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(environment)


@job("two")
def trainer_distributed_config():
    """Transformers' Trainer on models sharded at load time by DistributedConfig (examples/trainer_distributed.py):
    FSDP2 with all-to-all expert parallelism over the FSDP ranks and gradient accumulation (GPT-MoE), FSDP2
    (Seq2Seq-MoE) = one process; a tensor-parallel layout is refused by Accelerate on CPU."""
    from transformers import DistributedConfig, Trainer, TrainingArguments
    from trainer_distributed import compare

    runs = {
        "gpt/fsdp2_ep2_all_to_all": ("gpt", dict(fsdp_size=2, ep_size=2, ep_implementation="all_to_all"), 2),
        "seq2seq/fsdp2": ("seq2seq", dict(fsdp_size=2), 1),
    }
    results = {}
    for name, (family, layout, accumulation) in runs.items():
        output_dir = os.path.join(os.environ["PARALLEL_TEST_DIR"], f"trainer_{family}")
        with accelerate_session():
            results[name] = compare(
                family, DistributedConfig(**layout), accumulation=accumulation, output_dir=output_dir
            )
    with accelerate_session():
        model = GPTMoEForCausalLM.from_pretrained(
            os.path.join(os.environ["PARALLEL_TEST_DIR"], "trainer_gpt", "initial_gpt"),
            distributed_config=DistributedConfig(tp_size=2),
        )
        args = TrainingArguments(output_dir=os.environ["PARALLEL_TEST_DIR"], report_to=[], use_cpu=True)
        try:
            Trainer(model=model, args=args)
        except ValueError as e:
            results["tp_on_cpu"] = str(e)
    return results


@job("two")
def deepspeed_zero3():
    """DeepSpeed ZeRO-3 through Accelerate (gloo, CPU), plain loop, each rank on its half of every batch = one process
    accumulating both halves, through three AdamW steps with clipping: GPT-MoE loaded under ZeRO-3's partitioned
    init (`from_pretrained` while the DeepSpeed config is active, as the Trainer does), Seq2Seq-MoE built in memory."""
    try:
        import deepspeed
    except ImportError:
        return {"skipped": "deepspeed is not installed (pip install deepspeed, or the test extra)"}
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    # the CPU backend's shared-memory collectives are a C++ extension compiled on first use (minutes on 2 cores)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    rank, results = dist.get_rank(), {}
    for family, settings in [("gpt", GATES["topk_capacity_shared"]), ("seq2seq", SEQ2SEQ_GATES["prototype_capacity"])]:
        seq2seq = family == "seq2seq"
        ref = build(seq2seq=seq2seq, **settings)
        path = os.path.join(os.environ["PARALLEL_TEST_DIR"], f"zero3_{family}")
        save_checkpoint(settings, path, seq2seq)
        with accelerate_session():
            zero3 = {"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0,
                     "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * dist.get_world_size()}
            # backend: Accelerate counts the processes of a CPU DeepSpeed job only when it is named
            accelerator = Accelerator(
                deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=zero3),
                kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
            )
            model = build(seq2seq=True, **settings) if seq2seq else GPTMoEForCausalLM.from_pretrained(path).train()
            numel_at_load = sum(p.numel() for p in model.parameters())
            model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
            ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
            steps = []
            for step in range(3):
                halves = [tuple(t[i : i + 2] for t in batch(seed=step + 1, seq2seq=seq2seq)) for i in (0, 2)]
                ref_losses = []
                for ids, mask, labels in halves:
                    loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
                    (loss / 2).backward()
                    ref_losses.append(loss.item())
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
                ref_optimizer.step()
                ref_optimizer.zero_grad()
                ids, mask, labels = halves[rank]
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                steps.append({"loss": loss.item(), "ref_loss": ref_losses[rank]})
            inner = accelerator.unwrap_model(model)
            with deepspeed.zero.GatheredParameters(list(inner.parameters())):
                params_after = max_diff(inner, ref, what="param")
            results[family] = {
                "steps": steps, "params_after": params_after, "processes": accelerator.num_processes,
                "numel_at_load": numel_at_load,
            }
    return results


@job("two")
def errors():
    """Clear errors: experts that do not split, a mesh that does not match the world size."""
    results = {}
    try:
        parallelize(build(num_experts=3, num_experts_per_tok=2), dist.group.WORLD)
    except ValueError as e:
        results["experts"] = str(e)
    try:
        make_mesh(pp=1, tp=3)
    except ValueError as e:
        results["world_size"] = str(e)
    return results


@job("two")
def hung_rank_times_out():
    """Rank 1 stays alive but skips a collective: rank 0's all-reduce fails after the group's timeout."""
    group = make_mesh(tp=2, timeout=timedelta(seconds=2))["tp"].get_group()
    x = torch.ones(2)
    dist.all_reduce(x, group=group)  # the group works
    start = time.monotonic()
    if dist.get_rank() == 1:
        time.sleep(4)
        return {}
    try:
        dist.all_reduce(x, group=group)
    except RuntimeError as e:
        return {"error": str(e).splitlines()[0], "seconds": time.monotonic() - start}
    return {"error": None}


@job("two")
def dead_rank_fails_fast():
    """Rank 1 exits: rank 0's next collective fails at once, long before the timeout (the last check of the job)."""
    group = make_mesh(tp=2, timeout=timedelta(seconds=30))["tp"].get_group()
    dist.barrier(group=group)
    if dist.get_rank() == 1:
        raise SystemExit  # the job writes this rank's results, then the process exits
    time.sleep(1)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2), group=group)
    except RuntimeError as e:
        return {"error": str(e).splitlines()[0], "seconds": time.monotonic() - start}
    return {"error": None}


# ---------------------------------------------------------------------------------------------- pipelines


SEQ2SEQ_PIPELINE = dict(seq2seq=True, router_jitter_noise=0.1, moe_layer_frequency=1, **T5_V10)


def run_pipeline(schedule, style, pp, tp, microbatches=2, steps=2, layers=2):
    seq2seq = style.get("seq2seq", False)
    depth = dict(num_hidden_layers=layers, num_decoder_layers=layers) if seq2seq else dict(num_hidden_layers=4)
    settings = {"router_type": "gshard", "capacity_factor": 1.0, "moe_layer_frequency": 2, **depth, **style}
    ref, model = build(**settings), build(**settings)
    pipe = Pipeline(model, pp, num_microbatches=microbatches, schedule=schedule, tp=tp)
    stage = pipe.module.model
    # a stage's layer i is the model's layer layer_idx (its attention knows it)
    stacks = [(n, m) for n, m in stage.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList)]
    original = {f"{n}.{i}.": f"{n}.{layer.self_attn.layer_idx}." for n, m in stacks for i, layer in enumerate(m)}
    ref_names = dict(ref.named_parameters())

    def name_of(name):
        for local, index in original.items():
            if name.startswith(local):
                return index + name[len(local) :]
        # a head tied to the embeddings
        return name if name in ref_names else ("model.shared.weight" if seq2seq else "model.embed_tokens.weight")

    opt = torch.optim.SGD(stage.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    out = []
    for step in range(steps):
        ids, mask, labels = batch(seed=step + 1, seq2seq=seq2seq)
        loss = pipe.step(ids, labels, mask).item()
        ref_loss = accumulate(ref, ids, mask, labels, microbatches)
        out.append({"loss": loss, "ref_loss": ref_loss, "grad": max_diff(stage, ref, name_of)})
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return {"steps": out, "params_after": max_diff(stage, ref, name_of, what="param"), "holders": pipe.holders}


def accumulate(ref, ids, mask, labels, microbatches):
    """Single-process gradient accumulation: token-summed LM loss / the batch's label tokens, plus the mean of the
    microbatches' router losses (what `Pipeline` documents)."""
    # a causal LM predicts token t+1 at position t, an encoder-decoder every label
    num_tokens = ((labels if ref.config.is_encoder_decoder else labels[:, 1:]) != -100).sum()
    total = 0.0
    for chunk in zip(*(t.chunk(microbatches) for t in (ids, mask, labels))):
        out = ref(input_ids=chunk[0], attention_mask=chunk[1], labels=chunk[2], num_items_in_batch=num_tokens)
        config = ref.config
        router = config.router_aux_loss_coef * out.aux_loss + config.router_z_loss_coef * out.z_loss
        # the model weighs its router losses by the chunk's share of the label tokens; the pipeline takes their mean
        share = router_loss_weight(chunk[2] if config.is_encoder_decoder else chunk[2][:, 1:], num_tokens)
        loss = out.loss - share * router + router / microbatches
        loss.backward()
        total += loss.item()
    return total


# ---------------------------------------------------------------------------------------------- 4 ranks


@job("four")
def tp_times_pp():
    """TP=2 x PP=2 on a (pp, tp) mesh, both schedules: loss and gradients = single-process accumulation (q/k norm
    gradients, partial per TP rank, summed per microbatch: accumulation must not sum them twice)."""
    mesh = make_mesh(pp=2, tp=2, timeout=timedelta(seconds=60))
    results = {}
    for schedule, (style_name, style) in [("gpipe", ("qwen3", QWEN3)), ("1f1b", ("gpt2", GPT2_STYLE))]:
        results[f"{schedule}/{style_name}"] = run_pipeline(schedule, style, mesh["pp"], mesh["tp"])
    results["1f1b/seq2seq"] = run_pipeline("1f1b", SEQ2SEQ_PIPELINE, mesh["pp"], mesh["tp"])
    return results


@job("four")
def seq2seq_four_stages():
    """PP=4 over a 3 + 3 layer encoder-decoder: [enc 0-1] -> [enc 2, dec 0] -> [dec 1] -> [dec 2, head]: encoder
    hidden states, then (decoder hidden, encoder output) cross stages; the third stage passes the encoder output on."""
    return {"gpipe": run_pipeline("gpipe", SEQ2SEQ_PIPELINE, dist.group.WORLD, None, layers=3)}


@job("four")
def sharded_memory():
    """Bytes of parameters, gradients and AdamW state per rank after one step, for the training entry point's layouts
    (benchmarks/memory.py's measurement, on a small model): the whole model's (1 process) and each layout's per rank."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.memory import measure

    config = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_experts=4, num_experts_per_tok=2, moe_layer_frequency=2)
    layouts = {"whole": {}, "fsdp4": dict(fsdp=4), "replicas2_fsdp2": dict(fsdp=2), "fsdp2_tp2": dict(fsdp=2, tp=2),
               "fsdp2_pp2": dict(fsdp=2, pp=2), "fsdp4_ep4": dict(fsdp=4, ep=4), "tp2_pp2": dict(tp=2, pp=2)}
    return {name: measure(layout, config) for name, layout in layouts.items()}


def main(job_name: str, out_dir: str) -> None:
    init_distributed(timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    results, path = {}, Path(out_dir, f"rank{rank}.json")
    for check in JOBS[job_name]:
        try:
            results[check.__name__] = check()
        except SystemExit:
            results[check.__name__] = {}
            path.write_text(json.dumps(results))
            os._exit(0)
        except Exception as e:  # recorded; the test of this check fails with the traceback
            results[check.__name__] = {"exception": traceback.format_exc(), "message": str(e)}
        path.write_text(json.dumps(results))
    if job_name != "two":  # the "two" job ends with a dead rank: no clean shutdown
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
