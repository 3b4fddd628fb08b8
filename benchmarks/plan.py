"""`hf_ppmoe.plan` against what can be checked: memory measured on CPU ranks, and step times published by the PPMoE
paper and measured on this project's H100.

    python benchmarks/plan.py memory [--max-world 8]   # torchrun on 2, 4 and 8 CPU processes (gloo): measured vs predicted
    python benchmarks/plan.py time                     # predicted vs published (no GPU: the planner only)

memory: three model shapes, each built and split exactly as `python -m hf_ppmoe.training` does it
(`hf_ppmoe.training.parallel_setup`), one training step (forward, backward, AdamW); every rank counts its state
(`hf_ppmoe.parallel.state_bytes`: parameters, gradients, AdamW state after the step) and the peak bytes autograd held
for the backward (`SavedTensors`: `torch.autograd.graph.saved_tensors_hooks`, each storage once, parameters and
FSDP's gathered copies of them excluded, a storage released when the last saved tensor using it is freed), and the
planner predicts both for that rank (`hf_ppmoe.planning`: state_bytes, stage_bytes x the microbatches in flight).

time: the protocol and every constant below were fixed, and committed, before the first comparison ran.
- Hardware: hf_ppmoe/planning/hardware.py (data sheets; efficiency factor per GPU kind: V100 0.30, H100 0.40).
- PPMoE Table 2 (arXiv 2304.11414): GPT-3 Medium (24 x 1024, 16 heads) and GPT-3 6.7B (32 x 4096, 32 heads) backbones
  as GPT-3 builds them (Brown et al. 2020, Table 2.1: learned positions, LayerNorm, GELU, biases, tied embeddings,
  vocabulary 50,257, sequence 2,048), 64 experts on every other FFN, top-1 (switch); fp16 weights and activations, 18
  bytes of state per parameter (2 weights + 4 fp32 gradients + 12 fp32 master weights and Adam moments, Sec. 4.1);
  global batch as GPT-3 trained these sizes: 0.5M tokens (256 sequences) for Medium, 2M (1,024) for 6.7B; micro-batch
  and activation recomputation chosen by the planner (the fastest that fits 32 GB: the paper sets the micro-batch "so
  that the GPU memory utilization is above 80%"); data-parallel gradients all-reduced once per step after the
  backward, not overlapped (Megatron-LM 2.x's local DDP; ZeRO stages 1 and 2 move the same bytes); "ZeRO" rows shard
  the optimizer state over the data-parallel ranks (`Layout.zero1`); V100 SXM2 32 GB nodes of 8 with NVLink and
  100 Gb/s InfiniBand per node (the paper's B = 12.5e9, Sec. 3.2). DPMoE rows as DeepSpeed-MoE 0.5.10 ran them: the
  expert-parallel group is min(64, DP) data-parallel ranks, and under tensor parallelism every tensor-parallel rank
  keeps whole experts and sends its whole (duplicated) batch through the all-to-all (DeepSpeed PR 2074, July 2022,
  added the dropping of the duplicates) (`Layout.expert_tokens="duplicated"`). Speed ratios against the setting's
  tensor x pipeline dense row, as the paper takes its slowest dense row as the baseline.
- PPMoE Table 1: the forward of the small DPMoE (DP 32, EP 64) by part; Table 3: the forward of one rank of the small
  PPMoE (TP 8 x PP 4), stage 1 (layers only): shares of the forward time. The two all-to-alls of Table 1 are equal in
  size under balanced routing: each is half of the predicted all-to-all time.
- H100 (benchmarks/results/gpu-2026-11-26-h100): one H100 SXM, B = 8, S = 2,048, the 8-layer H = 2,048 models of
  benchmarks/gpu.py (dense backbone with FFN 2,816; GPT-MoE E = 8, k = 2, expert FFN 1,408, every layer MoE), bf16
  weights and AdamW state (4 bytes per parameter), one micro-batch per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

PAPER = "PPMoE (arXiv 2304.11414)"

# ------------------------------------------------------------------------------------------------------------ time

GPT3 = dict(position_embedding_type="learned", norm_type="layernorm", gated_mlp=False, hidden_act="gelu_new",
            attention_bias=True, mlp_bias=True, tie_word_embeddings=True, vocab_size=50257,
            max_position_embeddings=2048)
MEDIUM = dict(GPT3, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16)
LARGE = dict(GPT3, hidden_size=4096, intermediate_size=16384, num_hidden_layers=32, num_attention_heads=32)
DENSE = dict(num_experts=1, num_experts_per_tok=1, router_type="switch", moe_layers=[])
MOE = dict(num_experts=64, num_experts_per_tok=1, router_type="switch", moe_layer_frequency=2)


def table2_rows():
    """(setting, model name, backbone, MoE?, the paper's DP TP PP EP ZeRO, our layout, GPUs, tokens/s/GPU, ratio %)."""
    from hf_ppmoe.planning import Layout

    small, large = [], []
    for dp, tp, pp, zero, tps in ((1, 8, 4, False, 3244), (4, 8, 1, True, 4174), (32, 1, 1, True, 5120)):
        small.append(("0.3B Dense", MEDIUM, False, (dp, tp, pp, 1, zero), Layout(tp=tp, pp=pp, fsdp=dp, zero1=zero),
                      32, tps, None))
    small += [
        ("6.7B DPMoE", MEDIUM, True, (32, 1, 1, 64, True), Layout(fsdp=32, ep=32, zero1=True), 32, 2147, 66.2),
        ("6.7B DPMoE", MEDIUM, True, (4, 8, 1, 64, True),
         Layout(fsdp=4, tp=8, ep=32, expert_tokens="duplicated", zero1=True), 32, 218, 6.7),
        ("6.7B PPMoE", MEDIUM, True, (1, 8, 4, 64, False), Layout(tp=8, pp=4), 32, 2708, 81.4),
    ]
    for dp, tp, pp, zero, tps in ((1, 8, 16, False, 356), (16, 8, 1, True, 597), (128, 1, 1, True, 410)):
        large.append(("6.7B Dense", LARGE, False, (dp, tp, pp, 1, zero), Layout(tp=tp, pp=pp, fsdp=dp, zero1=zero),
                      128, tps, None))
    large += [
        ("143B DPMoE", LARGE, True, (256, 1, 1, 64, True), Layout(fsdp=256, ep=64, zero1=True), 256, 93, 26.1),
        ("143B DPMoE", LARGE, True, (128, 2, 1, 64, True),
         Layout(fsdp=128, tp=2, ep=128, expert_tokens="duplicated", zero1=True), 256, 183, 51.4),
        ("143B DPMoE", LARGE, True, (32, 8, 1, 64, True),
         Layout(fsdp=32, tp=8, ep=256, expert_tokens="duplicated", zero1=True), 256, 63, 17.7),
        ("143B PPMoE", LARGE, True, (1, 8, 16, 64, False), Layout(tp=8, pp=16), 128, 323, 90.7),
    ]
    return {"small (32 V100)": small, "large (128-256 V100)": large}


def paper_run(setting: str):
    from hf_ppmoe.planning import Run

    return Run(seq_len=2048, global_batch=256 if setting.startswith("small") else 1024, dtype="float16",
               grad_bytes=4, optimizer_bytes=12, recompute=None, overlap_data_parallel=False)


def paper_estimate(backbone: dict, moe: bool, layout, gpus: int, run):
    """The planner's estimate for one of the paper's rows (the fastest micro-batch that fits; when none fits, micro-
    batch 1 with recomputation, marked)."""
    from dataclasses import replace

    from hf_ppmoe import GPTMoEConfig
    from hf_ppmoe.planning import Cluster
    from hf_ppmoe.planning.search import Rejected, best_estimate, estimate
    from hf_ppmoe.planning.shapes import model_spec

    spec = model_spec(GPTMoEConfig(**backbone, **(MOE if moe else DENSE)))
    cluster = Cluster.of("V100", gpus)
    result = best_estimate(spec, layout, run, cluster)
    if isinstance(result, Rejected):
        return estimate(spec, layout, replace(run, recompute=True), cluster, 1), result.reason
    return result, ""


def time_tables() -> tuple[list[str], dict]:
    from hf_ppmoe import GPTMoEConfig
    from hf_ppmoe.planning import Cluster, Layout, Run
    from hf_ppmoe.planning.shapes import model_spec
    from hf_ppmoe.planning.timing import forward_breakdown, step_time

    lines, data = [], {"table2": [], "table1": {}, "table3": {}, "h100": []}
    lines += ["| setting | model | DP TP PP EP ZeRO | published tokens/s/GPU | predicted | error | micro-batch x steps "
              "(recompute) | published ratio | predicted ratio | ratio error (points) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for setting, rows in table2_rows().items():
        run = paper_run(setting)
        estimates = [paper_estimate(backbone, moe, layout, gpus, run) for _, backbone, moe, _, layout, gpus, _, _ in rows]
        base_published, base_predicted = rows[0][6], estimates[0][0].time.tokens_per_second
        for (name, _, moe, sizes, layout, gpus, published, ratio), (est, misfit) in zip(rows, estimates):
            predicted = est.time.tokens_per_second
            dp, tp, pp, ep, zero = sizes
            ratio_pred = 100 * predicted / base_predicted
            ratio_pub = ratio if ratio is not None else None
            cells = [setting, name, f"{dp} {tp} {pp} {ep} {'x' if zero else '-'}", f"{published:,}", f"{predicted:,.0f}",
                     f"{predicted / published - 1:+.0%}",
                     f"{est.micro_batch} x {est.microbatches}{' (r)' if est.recompute else ''}{' *' if misfit else ''}",
                     f"{ratio_pub:.1f}%" if ratio_pub is not None else "-",
                     f"{ratio_pred:.1f}%" if ratio_pub is not None else "-",
                     f"{ratio_pred - ratio_pub:+.1f}" if ratio_pub is not None else "-"]
            lines.append("| " + " | ".join(cells) + " |")
            data["table2"].append({"setting": setting, "model": name, "sizes": sizes, "published": published,
                                   "predicted": predicted, "published_ratio": ratio, "predicted_ratio": ratio_pred,
                                   "estimate": est.to_dict(), "does_not_fit": misfit,
                                   "base_published": base_published})
    # Table 1: the small DPMoE's forward; Table 3: one rank (stage 1) of the small PPMoE
    run = paper_run("small")
    for key, layout, stage, published in (
        ("table1", Layout(fsdp=32, ep=32, zero1=True), 0,
         {"MoE forward": 82.6, "1st all-to-all": 33.7, "2nd all-to-all": 31.8, "gating": 2.1, "others": 17.3}),
        ("table3", Layout(tp=8, pp=4), 1,
         {"MoE forward": 38.2, "gating": 7.8, "expert calculation": 7.0, "MoE all-reduce": 20.7, "FFN forward": 27.4,
          "FFN all-reduce": 18.8}),
    ):
        est, _ = paper_estimate(MEDIUM, True, layout, 32, run)
        spec = model_spec(GPTMoEConfig(**MEDIUM, **MOE))
        parts = forward_breakdown(spec, layout, run, Cluster.of("V100", 32), stage, est.micro_batch)
        total = sum(parts.values())
        moe = parts["gating"] + parts["experts"] + parts["all_to_all"] + parts["moe_all_reduce"]
        predicted = {"MoE forward": moe, "gating": parts["gating"], "expert calculation": parts["experts"],
                     "1st all-to-all": parts["all_to_all"] / 2, "2nd all-to-all": parts["all_to_all"] / 2,
                     "MoE all-reduce": parts["moe_all_reduce"], "FFN forward": parts["ffn"] + parts["ffn_all_reduce"],
                     "FFN all-reduce": parts["ffn_all_reduce"], "others": total - moe}
        data[key] = {name: {"published": share, "predicted": 100 * predicted[name] / total}
                     for name, share in published.items()}
    for key, title in (("table1", "Table 1 (DPMoE DP 32 EP 64, forward)"), ("table3", "Table 3 (PPMoE TP 8 x PP 4, "
                                                                                        "stage 1, forward)")):
        lines += ["", f"| {title} | published share | predicted share | error (points) |", "|---|---|---|---|"]
        lines += [f"| {name} | {v['published']:.1f}% | {v['predicted']:.1f}% | {v['predicted'] - v['published']:+.1f} |"
                  for name, v in data[key].items()]
    # this project's H100 run
    gpu_model = dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=4, router_type="topk", norm_topk_prob=True, moe_layer_frequency=1,
                     max_position_embeddings=4096)
    run = Run(seq_len=2048, micro_batch=8, global_batch=8, dtype="bfloat16")
    lines += ["", "| H100, B = 8, S = 2,048 (2026-11-26) | measured ms/step | predicted | error |", "|---|---|---|---|"]
    for name, extra, measured in (("dense backbone", dict(intermediate_size=2816, num_experts=1, num_experts_per_tok=1,
                                                          moe_layers=[]), 84.9),
                                  ("GPT-MoE E=8 k=2", dict(intermediate_size=1408, num_experts=8,
                                                           num_experts_per_tok=2), 114.1)):
        spec = model_spec(GPTMoEConfig(**gpu_model, **extra))
        predicted = 1e3 * step_time(spec, Layout(), run, Cluster.of("H100", 1), 8, 1).total
        lines.append(f"| {name} | {measured} | {predicted:.1f} | {predicted / measured - 1:+.0%} |")
        data["h100"].append({"model": name, "measured_ms": measured, "predicted_ms": predicted})
    return lines, data


# ---------------------------------------------------------------------------------------------------------- memory

SHAPES = {
    "llama": dict(vocab_size=4096, hidden_size=128, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                  num_experts=8, num_experts_per_tok=2, moe_layer_frequency=2),
    "gpt2": dict(vocab_size=500, hidden_size=48, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
                 num_experts=4, num_experts_per_tok=1, router_type="switch", moe_layer_frequency=2,
                 position_embedding_type="learned", norm_type="layernorm", gated_mlp=False, hidden_act="gelu_new",
                 attention_bias=True, mlp_bias=True, tie_word_embeddings=True, max_position_embeddings=256),
    "gqa-bf16": dict(vocab_size=1024, hidden_size=64, intermediate_size=256, moe_intermediate_size=64,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=16,
                     num_experts_per_tok=4, moe_layer_frequency=1, dtype="bfloat16"),
}
SHAPES["llama-autocast"] = dict(SHAPES["llama"], autocast=True)  # float32 weights, bf16 autocast: hf_ppmoe.training
# per world size: (shape, layout, micro-batch, sequence length, pipeline microbatches)
LAYOUTS = {
    2: [("llama", {}, 2, 64, 1), ("gpt2", {"tp": 2}, 2, 128, 1), ("llama", {"pp": 2}, 2, 64, 2),
        ("gpt2", {"fsdp": 2, "ep": 2}, 2, 128, 1)],
    4: [("llama", {"fsdp": 2, "tp": 2}, 2, 64, 1), ("gpt2", {"fsdp": 2, "pp": 2}, 2, 128, 2),
        ("gqa-bf16", {"tp": 2, "pp": 2}, 2, 64, 4), ("llama", {"fsdp": 4, "ep": 4}, 2, 128, 1),
        ("gqa-bf16", {"fsdp": 2, "tp": 2, "ep": 4}, 2, 128, 1), ("gpt2", {"pp": 4}, 1, 128, 4),
        ("llama-autocast", {"fsdp": 2, "tp": 2}, 2, 64, 1)],
    8: [("llama", {"fsdp": 8}, 2, 64, 1), ("gqa-bf16", {"fsdp": 4, "tp": 2}, 2, 64, 1),
        ("gpt2", {"fsdp": 2, "tp": 2, "pp": 2}, 2, 128, 2), ("llama", {"fsdp": 8, "ep": 8}, 2, 128, 1),
        ("gqa-bf16", {"tp": 2, "pp": 4}, 1, 64, 8), ("llama-autocast", {"fsdp": 4, "pp": 2}, 2, 64, 2)],
}


class SavedTensors:
    """`torch.autograd.graph.saved_tensors_hooks` that keep the bytes autograd holds for the backward: each storage
    counted once while any saved tensor uses it, parameters (and FSDP's gathered copies) left out; `peak` the most at
    once."""

    def __init__(self, model):
        self.model, self.live, self.bytes, self.peak = model, {}, 0, 0

    @staticmethod
    def _local(t):
        from torch.distributed.tensor import DTensor

        return t.to_local() if isinstance(t, DTensor) else t

    def pack(self, tensor):
        storage = self._local(tensor).untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in {self._local(p).untyped_storage().data_ptr() for p in self.model.parameters()}:
            return tensor
        count = self.live.setdefault(key, [0, size])
        if count[0] == 0:
            self.bytes += size
            self.peak = max(self.peak, self.bytes)
        count[0] += 1
        return _Held(self, key, tensor)

    def release(self, key):
        count = self.live[key]
        count[0] -= 1
        if count[0] == 0:
            self.bytes -= count[1]
            del self.live[key]

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda held: getattr(held, "tensor", held))


class _Held:
    __slots__ = ("owner", "key", "tensor")

    def __init__(self, owner, key, tensor):
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self):
        self.owner.release(self.key)


def balanced_routes(config: dict, tokens: int) -> tuple:
    """Router replay ids that give every expert the same number of routes from every slice of the batch: token t's
    k-th route goes to expert (t K + k) mod E, in every MoE layer."""
    import torch

    E, K = config["num_experts"], config["num_experts_per_tok"]
    ids = (torch.arange(tokens * K) % E).view(tokens, K)
    frequency = config.get("moe_layer_frequency", 2)
    layers = sum((i + 1) % frequency == 0 for i in range(config["num_hidden_layers"]))
    return tuple(ids for _ in range(layers))


def measure(shape: str, sizes: dict, micro_batch: int, seq_len: int, microbatches: int) -> dict:
    """On every rank of the job: build, split as hf_ppmoe.training does, two training steps (the first sets a
    pipeline's shapes up); this rank's state after them, the peak bytes autograd held and the collectives of the
    second step ((op, bytes) as `count_collectives` records them, sorted). Layouts whose experts exchange tokens
    (all-to-all) replay balanced routes in the second step (`balanced_routes`: the routing the planner assumes); the
    first step's peak, with the router's own routes, is reported beside."""
    import contextlib

    import torch
    import torch.distributed as dist

    from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
    from hf_ppmoe.parallel import count_collectives, state_bytes
    from hf_ppmoe.training.parallel_setup import DataParallelGroup, split_model

    config = dict(SHAPES[shape])
    dtype = getattr(torch, config.pop("dtype", "float32"))
    autocast = config.pop("autocast", False)
    flags = dict(tp_size=sizes.get("tp", 1), pp_size=sizes.get("pp", 1), fsdp_size=sizes.get("fsdp", 1))
    world = dist.get_world_size()
    dp = DataParallelGroup(SimpleNamespace(process_index=dist.get_rank(), num_processes=world), **flags,
                           ep_size=sizes.get("ep"))
    torch.manual_seed(0)
    model = GPTMoEForCausalLM(GPTMoEConfig(**config)).to(dtype).train()
    args = SimpleNamespace(**flags, gradient_accumulation_steps=microbatches, fsdp_reshard_after_forward=True)
    model, pipe = split_model(model, args, dp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = micro_batch * (microbatches if pipe is not None else 1)
    ids = torch.randint(3, config["vocab_size"], (rows, seq_len), generator=torch.Generator().manual_seed(dp.rank))
    peaks, comm = [], None
    for step in range(2):
        balanced = step and sizes_all_to_all(sizes)  # (no pipeline layout here exchanges tokens)
        replay = {"router_expert_ids": balanced_routes(config, rows * seq_len)} if balanced else {}
        saved = SavedTensors(model)
        precision = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with count_collectives() as comm, saved.hooks():
            with precision:
                loss = pipe.step(ids, ids) if pipe is not None else model(ids, labels=ids, **replay).loss
            if pipe is None:
                loss.backward()
        peaks.append(saved.peak)
    optimizer.step()
    return {"state": state_bytes(model, optimizer), "activations": peaks[1], "own_routing": peaks[0],
            "collectives": sorted((c.op, c.bytes) for c in comm.calls)}


def predicted_collectives(shape: str, sizes: dict, world: int, rank: int, micro_batch: int, seq_len: int,
                          microbatches: int) -> list:
    """The planner's (op, bytes) of the same step on `rank`, sorted."""
    from hf_ppmoe import GPTMoEConfig
    from hf_ppmoe.planning import Layout, Rank, Run
    from hf_ppmoe.planning.communication import micro_batch_collectives, step_collectives
    from hf_ppmoe.planning.shapes import model_spec

    config = dict(SHAPES[shape])
    autocast = config.pop("autocast", False)
    run = Run(seq_len=seq_len, dtype="bfloat16" if autocast else config.pop("dtype", "float32"),
              master_weights=autocast)
    spec = model_spec(GPTMoEConfig(**config))
    tp, pp, fsdp = sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("fsdp", 1)
    layout = Layout(tp=tp, pp=pp, fsdp=fsdp, dp=world // (tp * pp * fsdp), ep=sizes.get("ep"))
    where = Rank.of(layout, rank)
    steps = microbatches if pp > 1 else 1  # the benchmark's step: one micro-batch, or the pipeline's microbatches
    calls = micro_batch_collectives(spec, layout, run, micro_batch * seq_len, where.stage) * steps
    calls += step_collectives(spec, layout, run, where, steps)
    return sorted((x.op, x.bytes) for x in calls)


def predict(shape: str, sizes: dict, world: int, micro_batch: int, seq_len: int, microbatches: int) -> list[dict]:
    """The planner's numbers for every rank of the same run."""
    from hf_ppmoe import GPTMoEConfig
    from hf_ppmoe.planning import Layout, Rank, Run
    from hf_ppmoe.planning.search import rank_memory
    from hf_ppmoe.planning.shapes import model_spec
    from hf_ppmoe.planning.state import state_bytes

    config = dict(SHAPES[shape])
    autocast = config.pop("autocast", False)
    run = Run(seq_len=seq_len, dtype="bfloat16" if autocast else config.pop("dtype", "float32"),
              master_weights=autocast)
    spec = model_spec(GPTMoEConfig(**config))
    tp, pp, fsdp = sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("fsdp", 1)
    layout = Layout(tp=tp, pp=pp, fsdp=fsdp, dp=world // (tp * pp * fsdp), ep=sizes.get("ep"))
    out = []
    for r in range(world):
        rank = Rank.of(layout, r)
        memory = rank_memory(spec, layout, run, rank, micro_batch, microbatches)
        out.append({"state": state_bytes(spec, layout, run, rank), "activations": memory.activations})
    return out


def worker(out: str) -> None:
    import torch.distributed as dist

    from hf_ppmoe.parallel import init_distributed

    init_distributed()
    world, results = dist.get_world_size(), []
    for shape, sizes, micro_batch, seq_len, microbatches in LAYOUTS[world]:
        ranks = [None] * world
        dist.all_gather_object(ranks, measure(shape, sizes, micro_batch, seq_len, microbatches))
        counted = [m.pop("collectives") for m in ranks]
        planned = [predicted_collectives(shape, sizes, world, r, micro_batch, seq_len, microbatches)
                   for r in range(world)]
        results.append({"shape": shape, "sizes": sizes, "micro_batch": micro_batch, "seq_len": seq_len,
                        "microbatches": microbatches, "measured": ranks,
                        "predicted": predict(shape, sizes, world, micro_batch, seq_len, microbatches),
                        # a model split by no flag is Accelerate's DDP in hf_ppmoe.training, which is not built here
                        "collectives_equal": counted == planned if sizes else None, "collectives": len(counted[0])})
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def sizes_all_to_all(sizes: dict) -> bool:
    return sizes.get("ep", sizes.get("tp", 1)) > sizes.get("tp", 1)


def layout_name(sizes: dict, world: int) -> str:
    tp, pp, fsdp = sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("fsdp", 1)
    parts = [f"{k} {v}" for k, v in (("dp", world // (tp * pp * fsdp)), ("fsdp", fsdp), ("pp", pp), ("tp", tp)) if v > 1]
    return " x ".join(parts) + (f" (ep {sizes['ep']})" if sizes.get("ep", tp) > tp else "")


def memory_table(results: list[dict]) -> list[str]:
    lines = ["| shape | layout | processes | micro-batch x S (microbatches) | state per rank: predicted = measured | "
             "activations per rank, measured (MiB) | activations: largest error | with the router's own routes | "
             "collectives of a step (rank 0): predicted = counted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        world = len(r["measured"])
        exact = all(m["state"] == p["state"] for m, p in zip(r["measured"], r["predicted"]))
        errors = [p["activations"] / m["activations"] - 1 for m, p in zip(r["measured"], r["predicted"])]
        own = [p["activations"] / m["own_routing"] - 1 for m, p in zip(r["measured"], r["predicted"])]
        acts = sorted({round(m["activations"] / 2**20, 2) for m in r["measured"]})
        shown = ", ".join(f"{a:.2f}" for a in acts[:4]) + (", ..." if len(acts) > 4 else "")
        state = sum(r["measured"][0]["state"].values()) / 2**20
        replayed = sizes_all_to_all(r["sizes"])
        lines.append(f"| {r['shape']} | {layout_name(r['sizes'], world)} | {world} | {r['micro_batch']} x "
                     f"{r['seq_len']} ({r['microbatches']}) | {'yes' if exact else 'NO'} ({state:.2f} MiB on rank 0) | "
                     f"{shown} | {max(errors, key=abs):+.2%}{' (balanced routes)' if replayed else ''} | "
                     f"{f'{min(own):+.1%} to {max(own):+.1%}' if replayed else 'the same'} | "
                     f"{ {True: 'yes', False: 'NO', None: 'n/a (DDP)'}[r['collectives_equal']]} ({r['collectives']}) |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("section", choices=["memory", "time"])
    parser.add_argument("--max-world", type=int, default=8, choices=sorted(LAYOUTS))
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    if args.section == "time":
        lines, data = time_tables()
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        data = []
        with tempfile.TemporaryDirectory() as tmp:
            for world in (w for w in sorted(LAYOUTS) if w <= args.max_world):
                out = Path(tmp, f"{world}.json")
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                           __file__, "memory", f"--worker={out}"]
                subprocess.run(command, env=env, check=True, capture_output=True)
                data += json.loads(out.read_text())
        lines = memory_table(data)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
