"""The collectives one rank issues, per layer and per step, and how long each takes on a cluster.

Each `Collective` carries `bytes` as `hf_ppmoe.parallel.count_collectives` records it (the first tensor the op gets:
an all-reduce's tensor, an all-to-all's send rows, a functional all-gather's input shard, FSDP's all-gather output and
reduce-scatter output), so predictions compare with counts one to one (tests/planning), and `message`: the whole
message the time is computed from (the reduced or gathered tensor, the rows one rank sends).

Per layer, with tensor parallelism over tp ranks (T tokens of a micro-batch, H hidden, a bytes per element):
- attention and dense FFN: one all-reduce [T, H] forward (the row-split output projection) and one backward (the
  input's gradient, "replicated_input"); Qwen3's per-head norms add [D] gradients.
- MoE, PPMoE (experts over the tp ranks): the dense FFN's two, plus the routing weights' gradient [T, K] backward.
- MoE, all-to-all (Transformers' AllToAllEP, experts over ep > tp ranks): forward, the per-expert counts [E] (int64),
  the T/tp x K routed rows out, the expert outputs back (as many rows as this rank's experts received: T/tp x K when
  routing is balanced, which is what is predicted), and with tp > 1 an all-gather of the [T/tp, H] outputs;
  backward, the two row exchanges again and, with tp > 1, all-gathers of the [T/tp, K] weights' and [T/tp, H] inputs'
  gradients.
Per micro-batch on the pipeline's ends: the vocabulary-split embedding's all-reduce [T, H] and the head's all-gather of
[T, V/tp] logits forward with an all-reduce [T, H] backward. Per step: FSDP's all-gather of each layer's parameters
(forward, and again backward after resharding) and reduce-scatter of its gradients, HSDP's all-reduce of the shards
over the replicas, DDP's all-reduce of the gradients; a pipeline sends [T, H] to the next stage and its gradient back.

Time (ring algorithms, NCCL's cost model without latency): an all-reduce of m bytes over n ranks moves 2(n-1)/n m
per rank, an all-gather or reduce-scatter (n-1)/n of the whole, an all-to-all (n-1)/n of the rows a rank sends.
A group of g ranks per node on k nodes runs hierarchically: its intra-node part at NVLink speed, its inter-node part
(1/g of the data per GPU) at the GPU's share of the node's network, one after the other; an all-to-all runs both at
once (the slower decides).
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Cluster
from .layouts import Layout, Rank, Run, split_layers
from .shapes import ModelSpec


@dataclass(frozen=True)
class Collective:
    op: str  # count_collectives' name
    group: str  # "tp", "ep", "fsdp", "experts" (the experts' FSDP shards), "dp", "batch", "pp"
    bytes: int  # what count_collectives records
    message: float  # bytes the time is computed from (module docstring)
    phase: str  # "forward" or "backward"
    what: str = ""


def _tp(T: int, H: int, a: int, phase: str, what: str) -> Collective:
    return Collective("all_reduce", "tp", T * H * a, T * H * a, phase, what)


def layer_collectives(spec: ModelSpec, layout: Layout, run: Run, T: int, kind: str) -> list[Collective]:
    """The collectives of one layer's part `kind` ("attention", "dense_ffn", "moe") for a micro-batch of T tokens,
    forward then backward (no recomputation). Under autocast the residual stream is float32 (`Run.stream_bytes`), and
    so are the gradients reduced into it; a row-split projection's and the experts' outputs are 16-bit (measured on
    CPU autocast)."""
    c, a, tp = spec.config, run.stream_bytes, layout.tp
    H, K = c.hidden_size, c.num_experts_per_tok
    out: list[Collective] = []
    if kind == "moe" and layout.all_to_all:
        T_l, E = (T if layout.expert_tokens == "duplicated" else T // tp), c.num_experts
        rows, back = T_l * K * H * a, T_l * K * H * run.act_bytes
        out += [Collective("alltoall_base_", "ep", 8 * E, 8 * E, "forward", "expert counts"),
                Collective("all_to_all_single", "ep", rows, rows, "forward", "routed rows out"),
                Collective("all_to_all_single", "ep", back, back, "forward", "expert outputs back")]
        sliced = tp > 1 and layout.expert_tokens == "sliced"
        if sliced:
            out.append(Collective("all_gather_into_tensor", "tp", T_l * H * a, T * H * a, "forward", "outputs"))
        out += [Collective("all_to_all_single", "ep", back, back, "backward", "output gradients"),
                Collective("all_to_all_single", "ep", rows, rows, "backward", "input gradients")]
        if sliced:  # the routing weights reach the experts in the activations' dtype
            out += [Collective("all_gather_into_tensor", "tp", T_l * K * a, T * K * a, "backward", "weights' gradient"),
                    Collective("all_gather_into_tensor", "tp", T_l * H * a, T * H * a, "backward", "input gradient")]
        if c.shared_expert_intermediate_size and tp > 1:
            out += [_tp(T, H, a, "forward", "shared expert"), _tp(T, H, a, "backward", "shared expert")]
        return out
    if tp == 1:
        return out
    # forward: a row-split projection's or the experts' output (16-bit under autocast); backward: gradients in the
    # stream's dtype, the routing weights' too (cast to the tokens' dtype before they reach the experts)
    out.append(_tp(T, H, run.act_bytes, "forward", kind))
    if kind == "moe" and c.shared_expert_intermediate_size:
        out.append(_tp(T, H, run.act_bytes, "forward", "shared expert"))
    if kind == "moe":  # in autograd's order: the routing weights' gradient, then the tokens'
        out.append(Collective("all_reduce", "tp", T * K * a, T * K * a, "backward", "routing weights' gradient"))
        if c.shared_expert_intermediate_size:
            out.append(_tp(T, H, a, "backward", "shared expert"))
    out.append(_tp(T, H, a, "backward", kind))
    if kind == "attention" and c.qk_norm:
        norm = c.head_dim * run.param_bytes
        out += [Collective("all_reduce", "tp", norm, norm, "backward", "q_norm gradient"),
                Collective("all_reduce", "tp", norm, norm, "backward", "k_norm gradient")]
    return out


def micro_batch_collectives(spec: ModelSpec, layout: Layout, run: Run, T: int, stage: int) -> list[Collective]:
    """Every collective one micro-batch of T tokens issues on stage `stage` (tensor, expert and pipeline
    parallelism); recomputation repeats the layers' forward ones in the backward pass."""
    c, a, tp = spec.config, run.stream_bytes, layout.tp
    H = c.hidden_size
    out: list[Collective] = []
    if stage == 0 and tp > 1:
        out.append(_tp(T, H, a, "forward", "embedding"))
    for layer in split_layers(spec.layers, layout.pp)[stage]:
        for kind in ("attention", "moe" if spec.is_moe(layer) else "dense_ffn"):
            part = layer_collectives(spec, layout, run, T, kind)
            out += part
            if run.recompute:
                out += [Collective(x.op, x.group, x.bytes, x.message, "backward", x.what + " (recomputed)")
                        for x in part if x.phase == "forward"]
    if stage == layout.pp - 1 and tp > 1:
        V_l = -(-c.vocab_size // tp)
        logits = run.act_bytes  # the head's output: 16-bit under autocast
        out += [Collective("all_gather_into_tensor", "tp", T * V_l * logits, T * V_l * tp * logits, "forward", "logits"),
                _tp(T, H, a, "backward", "head")]
    if layout.pp > 1:  # torch.distributed.pipelining's sends and receives (count_collectives records both)
        if stage < layout.pp - 1:
            out += [Collective("send", "pp", T * H * a, T * H * a, "forward", "activations to the next stage"),
                    Collective("recv_", "pp", T * H * a, 0, "backward", "gradients from the next stage")]
        if stage > 0:
            out += [Collective("recv_", "pp", T * H * a, 0, "forward", "activations from the previous stage"),
                    Collective("send", "pp", T * H * a, T * H * a, "backward", "gradients to the previous stage")]
    return out


def step_collectives(spec: ModelSpec, layout: Layout, run: Run, rank: Rank, microbatches: int) -> list[Collective]:
    """Data-parallel collectives of one optimizer step: FSDP's all-gathers (every micro-batch) and reduce-scatters
    (the last), HSDP's and DDP's all-reduces."""
    from .state import held_params

    g, p = run.grad_bytes_, run.param_bytes
    # hf_ppmoe.parallel.Pipeline sums the step's loss parts (LM, aux, z: float32) over the stages, and the first and
    # last stages exchange the gradients of a tied embedding's two copies
    out = [Collective("all_reduce", "pp", 12, 12, "backward", "loss parts")] if layout.pp > 1 else []
    held = held_params(spec, layout, run, rank)
    if layout.pp > 1 and spec.tied and rank.stage in (0, layout.pp - 1):  # this rank's shard of the copies' gradient
        name = "model.embed_tokens.weight" if rank.stage == 0 else "lm_head.weight"
        grad = next(h.numel for h in held if h.param.name == name) * g
        out += [Collective("send", "pp", grad, grad, "backward", "tied embedding gradient"),
                Collective("recv_", "pp", grad, 0, "backward", "tied embedding gradient")]
    if layout.data_parallel == 1:
        return out
    if not layout.split or layout.zero1:  # Accelerate's DDP (or ZeRO-1): all-reduces of the gradients, once a step
        grads = sum(h.grad_numel for h in held if not h.apart) * g
        out.append(Collective("all_reduce", "batch", grads, grads, "backward", "gradients"))
        experts = sum(h.grad_numel for h in held if h.apart) * g
        if experts and layout.data_parallel // (layout.ep_size // layout.tp) > 1:
            out.append(Collective("all_reduce", "experts", experts, experts, "backward", "experts' gradients"))
        return out
    units: dict[object, list] = {}
    for h in held:
        units.setdefault(h.unit, []).append(h)
    for key, members in units.items():
        shards, apart = members[0].shards, members[0].apart
        whole = sum(h.gathered for h in members)  # padded to equal shards
        trained = sum(h.gathered for h in members if h.trainable)
        name = "root" if key is None else f"layer {key}" if not apart else f"experts of layer {key[1]}"
        if shards > 1:
            # every forward gathers, and every backward after a resharding forward; a pipeline keeps the layers
            # gathered from its first backward to its last (torch.distributed.pipelining: no resharding between)
            if layout.pp > 1:
                gathers = microbatches + 1 if run.reshard_after_forward else 1
            else:
                gathers = microbatches * (2 if run.reshard_after_forward else 1)
            out += [Collective("_allgather_base_", "experts" if apart else "fsdp", whole * p, whole * p, "forward",
                               name)] * gathers
            if trained:
                out.append(Collective("_reduce_scatter_base_", "experts" if apart else "fsdp", trained // shards * g,
                                      trained * g, "backward", name))
        replicas = layout.dp if shards > 1 or apart else layout.data_parallel
        local = trained // shards if shards > 1 else sum(h.grad_numel for h in members)
        if replicas > 1 and local:
            out.append(Collective("all_reduce", "dp", local * g, local * g, "backward", name + " over replicas"))
    return out


def group_span(layout: Layout, cluster: Cluster, group: str) -> tuple[int, int, int]:
    """(ranks, ranks per node, nodes) of the `group` holding rank 0 (groups are alike), ranks placed (dp, fsdp, pp,
    tp) with tp innermost and consecutive ranks on a node."""
    tp, pp, F, dp = layout.tp, layout.pp, layout.fsdp, layout.dp
    k = layout.ep_size // tp
    members = {
        "tp": [t for t in range(tp)],
        "pp": [s * tp for s in range(pp)],
        "fsdp": [f * pp * tp for f in range(F)],
        "ep": [(f * pp) * tp + t for f in range(k) for t in (range(tp) if layout.expert_tokens == "sliced" else [0])],
        "experts": [e * k * pp * tp for e in range(max(1, F // k))],
        "dp": [d * F * pp * tp for d in range(dp)],
        "batch": [(d * F + f) * pp * tp for d in range(dp) for f in range(F)],
    }[group]
    per_node: dict[int, int] = {}
    for r in members:
        per_node[r // cluster.gpus_per_node] = per_node.get(r // cluster.gpus_per_node, 0) + 1
    return len(members), max(per_node.values()), len(per_node)


def collective_time(x: Collective, layout: Layout, cluster: Cluster) -> float:
    """Seconds `x` takes (module docstring)."""
    if x.group == "pp":
        same_node = cluster.gpus <= cluster.gpus_per_node or layout.tp * 2 <= cluster.gpus_per_node
        return x.message / (cluster.gpu.nvlink if same_node else cluster.nic_per_gpu)
    n, g, nodes = group_span(layout, cluster, x.group)
    if n == 1:
        return 0.0
    nv, nic = cluster.gpu.nvlink, cluster.nic_per_gpu
    m = x.message
    if x.op.startswith("all_to_all") or x.op.startswith("alltoall"):
        return max(m * (g - 1) / n / nv, m * (n - g) / n / nic)
    factor = 2 if x.op == "all_reduce" else 1
    intra = factor * (g - 1) / g * m / nv
    inter = factor * (nodes - 1) / nodes * (m / g) / nic if nodes > 1 else 0.0
    return intra + inter


__all__ = ["Collective", "collective_time", "group_span", "layer_collectives", "micro_batch_collectives",
           "step_collectives"]
