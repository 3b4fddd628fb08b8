"""Bytes autograd keeps for the backward pass (saved tensors, each storage once) of one micro-batch on one rank: what
OUR model saves, read from its code and checked against `torch.autograd.graph.saved_tensors_hooks` in one training
step on every layout (benchmarks/plan.py, tests/planning/test_planning.py). Parameters (and FSDP's gathered copies of
them) are not activations.

Legend: T tokens of the micro-batch (B sequences x S), H hidden, a bytes per activation element (the dtype's),
N / N_kv / D this rank's query and key-value heads and the head dim, I FFN inner size (this rank's share under tensor
parallelism), E_l this rank's experts, K routes per token, R routed rows this rank's experts run (PPMoE: every route of
the batch, T x K, since routes to other ranks' experts sort to the end but keep their rows; all-to-all: the rows it
receives, T / tp x K when routing is balanced), V vocabulary.

Per decoder layer:
- RMSNorm: float32 input (4TH: the input itself in float32, a copy otherwise), 1/rms (4T), normalised (aTH), and its
  output, which the next linear layers save (aTH); LayerNorm: input (aTH), mean and 1/std (8T), output (aTH).
- attention (scaled_dot_product_attention, flash or memory-efficient kernels): rotated q and k, v, output
  (aT(2N + 2N_kv)D), log-sum-exp (4TN); the output projection's input is the kernel's output (same storage).
- dense FFN: the activation's saved tensors (measured per function on the meta device: `activation_profile`), the
  product (gated) and the down projection's input: SwiGLU 4aTI, GPT-2's gelu_new 5aTI.
- MoE: router float32 probabilities and logits (8TE), expert ids (8TK), log-sum-exp (4T), mean probabilities (4E),
  the top-k renormalisation (4TK + 4T); experts (the "index" implementation): gathered rows a(R + E_l)H, in-projection
  a(R + E_l)2I, activation (float32 SwiGLU in place: a(R + E_l)I; 16-bit: 2a(R + E_l)I), route order 8R, offsets
  4E_l; the combine's expert outputs and weights a(TKH + TK) (PPMoE also the bool mask of routes elsewhere, TK).
- once per micro-batch: token ids (8T), rotary cos and sin (2aSD); on the last stage the final norm, the float32
  log-probabilities (4TV) and the targets (8T).
- under autocast (`Run.master_weights`: float32 weights, as hf_ppmoe.training's --mixed_precision): the residual stream
  and the norms in float32, each linear layer reading a norm's output saves its own 16-bit cast of it (q, k and v: 3
  casts), and every matrix multiplication keeps its 16-bit copy of its weight until the backward (`weight_copies`):
  2 bytes per weight of the stage's linear layers, routers, experts and head: the linear layers' once per step
  (autocast caches them for its region, which holds all of a pipeline's microbatches), the experts' per micro-batch.
"""

from __future__ import annotations

from .layouts import Layout, Run, split_layers
from .shapes import ModelSpec, activation_profile


def _norm(config, T: int, run: Run, consumers: int = 1) -> int:
    """A norm's saved tensors and its output, which the following linear layers save. Under autocast (float32 weights)
    the residual stream and the norms stay float32, and each of the `consumers` linear layers reading the output saves
    its own 16-bit cast of it (autocast caches the casts of weights only)."""
    H, a = config.hidden_size, run.act_bytes
    inner = 4 if run.master_weights else a
    outputs = T * H * a * (consumers if run.master_weights else 1)
    if config.norm_type == "rmsnorm":
        return T * H * (4 + inner) + 4 * T + outputs
    return T * H * inner + 8 * T + outputs


def _ffn_tensors(config, gated: bool) -> int:
    """Tensors of the inner size a dense FFN keeps: the activation's, the gate product's and the down projection's
    input (each storage once)."""
    n, keeps_input, keeps_output = activation_profile(config.hidden_act)
    extra = n - keeps_input - keeps_output
    return keeps_input + extra + (3 if gated else 1)


def attention_bytes(spec: ModelSpec, layout: Layout, run: Run, T: int) -> int:
    c, a, tp = spec.config, run.act_bytes, layout.tp
    N, N_kv, D = c.num_attention_heads // tp, c.num_key_value_heads // tp, c.head_dim
    total = _norm(c, T, run, 3) + a * T * (2 * N + 2 * N_kv) * D + 4 * T * N
    if c.qk_norm:  # Qwen3's per-head RMSNorm of q and k: float32 input, 1/rms, normalised
        total += T * (N + N_kv) * D * (4 + a) + 4 * T * (N + N_kv)
    if c.hidden_dropout > 0:
        total += T * c.hidden_size  # the dropout's bool mask
    return total


def dense_ffn_bytes(spec: ModelSpec, layout: Layout, run: Run, T: int, inner: int | None = None) -> int:
    c = spec.config
    inner = (inner or c.intermediate_size) // layout.tp
    return run.act_bytes * T * inner * _ffn_tensors(c, c.gated_mlp)


def routed_rows(spec: ModelSpec, layout: Layout, T: int) -> int:
    """R: the rows this rank's experts run (module docstring)."""
    K = spec.config.num_experts_per_tok
    if layout.all_to_all and layout.expert_tokens == "sliced":
        return T // layout.tp * K
    return T * K


def moe_bytes(spec: ModelSpec, layout: Layout, run: Run, T: int) -> int:
    c, a = spec.config, run.act_bytes
    H, E, K, I = c.hidden_size, c.num_experts, c.num_experts_per_tok, spec.expert_inner
    E_l = E // layout.expert_group
    total = 8 * T * E + 8 * T * K + 4 * T + 4 * E
    if c.router_type != "switch":  # top-k selection kept its values and, renormalised, their sum
        total += 4 * T * K + (4 * T if c.norm_topk_prob else 0)
    if c.router_dtype == "float32" and a != 4:
        total += 4 * T * H  # the router's float32 copy of its input
    R = routed_rows(spec, layout, T)
    rows = R + E_l
    total += a * rows * H + a * rows * (2 * I if c.gated_mlp else I)
    n, keeps_input, keeps_output = activation_profile(c.hidden_act)
    if c.gated_mlp and c.hidden_act in ("silu", "swish"):  # the fused SwiGLU: in place in float32
        total += a * rows * I * (1 if a == 4 else 2)
    elif c.gated_mlp:
        total += a * rows * I * (n - keeps_input - keeps_output + 2)
    else:
        total += a * rows * I * (n - keeps_input - keeps_output + 1)
    if c.mlp_bias:
        total += 9 * rows  # each row's expert (int64) and whether it is routed (bool), for the masked biases
    total += 8 * R + 4 * E_l
    if layout.all_to_all:  # unit weights on the receiving side; the sender's order, outputs and weights
        T_l = T // layout.tp
        total += a * R + 16 * T_l * K + a * T_l * K * H + a * T_l * K
    else:
        total += a * T * K * H + a * T * K + (T * K if layout.ep_size > 1 else 0)
    if c.shared_expert_intermediate_size:
        total += dense_ffn_bytes(spec, layout, run, T, c.shared_expert_intermediate_size)
    return total


def layer_bytes(spec: ModelSpec, layout: Layout, run: Run, T: int, layer: int) -> int:
    """Saved bytes of decoder layer `layer` for a micro-batch of T tokens (without recomputation)."""
    c = spec.config
    moe = spec.is_moe(layer)
    ffn = moe_bytes(spec, layout, run, T) if moe else dense_ffn_bytes(spec, layout, run, T)
    readers = (1 + (2 if c.gated_mlp else 1) * bool(c.shared_expert_intermediate_size)) if moe else 1 + c.gated_mlp
    dropout = T * c.hidden_size if c.hidden_dropout > 0 else 0
    return attention_bytes(spec, layout, run, T) + _norm(c, T, run, readers) + ffn + dropout


def stage_bytes(spec: ModelSpec, layout: Layout, run: Run, stage: int, micro_batch: int) -> int:
    """Saved bytes of one micro-batch on pipeline stage `stage`. With recomputation a layer keeps only its input and
    the one being recomputed keeps everything at once (the largest)."""
    c, a = spec.config, run.act_bytes
    S = run.seq_len
    T = micro_batch * S
    layers = split_layers(spec.layers, layout.pp)[stage]
    per_layer = [layer_bytes(spec, layout, run, T, i) for i in layers]
    total = sum(per_layer) if not run.recompute else T * c.hidden_size * a * len(per_layer) + max(per_layer)
    if c.position_embedding_type == "rotary":  # in the residual stream's dtype
        total += 2 * (4 if run.master_weights else a) * S * c.head_dim
    if stage == 0:
        total += 8 * T + (8 * S if c.position_embedding_type == "learned" else 0)
        total += T * c.hidden_size if c.hidden_dropout > 0 else 0
    if stage == layout.pp - 1:
        total += _norm(c, T, run) + 4 * T * c.vocab_size + 8 * T
    return total


def weight_copies(held, run: Run, in_flight: int = 1) -> int:
    """Bytes of autocast's 16-bit copies of the weights a stage multiplies by (module docstring): every matrix but the
    embeddings (a head tied to them is cast as the head), as gathered by FSDP; 0 without autocast. Linear layers'
    casts are cached for the autocast region (one per step, whatever the pipeline's microbatches); the experts cast
    their weights themselves (autocast is off inside them), once per micro-batch in flight."""
    if not run.weight_copies:
        return 0
    total = 0
    for h in held:
        name = h.param.name
        if len(h.param.shape) < 2 or name.startswith("model.embed_positions"):
            continue
        if name.startswith("model.embed_tokens") and not h.tied_head:
            continue
        total += (h.gathered or h.numel) * (in_flight if h.param.expert else 1)
    return total * run.act_bytes


__all__ = ["attention_bytes", "dense_ffn_bytes", "layer_bytes", "moe_bytes", "routed_rows", "stage_bytes",
           "weight_copies"]
