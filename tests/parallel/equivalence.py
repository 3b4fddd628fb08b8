"""What the multi-process tests of this folder compare with one process: the models and gates they build, the batches,
and the differences they measure (they return numbers; the tests assert on them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import GPT2_STYLE, tiny_gpt_config, tiny_seq2seq_config
from torch.distributed.tensor import DTensor

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.modeling.loss import lm_targets, num_target_tokens
from hf_ppmoe.modeling.stages import is_held
from hf_ppmoe.moe.losses import router_loss
from hf_ppmoe.parallel import Pipeline, count_collectives

ATOL = 2e-6
LLAMA = {}
QWEN3 = dict(qk_norm=True)  # Llama's layout plus per-head q/k norms: replicated weights with partial gradients under TP
# the gates of the proof: capacity-limited, random routing, jitter, groups, padding; alternate the dense styles
GATES = {
    "gshard_random_capacity": dict(router_type="gshard", capacity_factor=1.0, router_num_groups=2, **QWEN3),
    "switch_jitter_capacity": dict(
        router_type="switch", num_experts_per_tok=1, capacity_factor=1.0, router_jitter_noise=0.1, **GPT2_STYLE
    ),
    "topk_capacity_shared": dict(router_type="topk", capacity_factor=0.5, shared_expert_intermediate_size=24),
    "topk_dropless_einsum": dict(router_type="topk", experts_implementation="einsum", **GPT2_STYLE),
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
    "topk_dropless_einsum": dict(router_type="topk", experts_implementation="einsum", moe_layer_frequency=2, **T5_V10),
    "prototype_capacity": dict(router_type="prototype", capacity_factor=0.75, shared_expert_intermediate_size=16),
}
SEQ2SEQ_PIPELINE = dict(seq2seq=True, router_jitter_noise=0.1, moe_layer_frequency=1, **T5_V10)


def gates(model):
    return [m for name, m in model.named_modules() if name.endswith("mlp.gate")]


def experts(model):
    return [m for name, m in model.named_modules() if name.endswith("mlp.experts")]


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


def save_checkpoint(settings, path, seq2seq=False):
    """build(**settings) saved by rank 0, for every rank to load."""
    if dist.get_rank() == 0:
        build(seq2seq=seq2seq, **settings).save_pretrained(path)
    dist.barrier()


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


def lm_step(model, ids, mask, labels):
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.item()


def train_pair(model, ref, step_fn=lm_step, steps=2):
    """`steps` optimizer steps on both models; per step {"loss", "ref_loss", "grad": largest gradient difference}."""
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


def collectives_of(run) -> dict:
    """[op, bytes] of every collective in run()'s forward and in the backward of its output's squared sum."""
    with count_collectives() as comm:
        y = run()
        comm.mark("backward")
        y.square().sum().backward()
    split = comm.marks["backward"]
    return {
        "forward": [[c.op, c.bytes] for c in comm.calls[:split]],
        "backward": [[c.op, c.bytes] for c in comm.calls[split:]],
    }


def run_pipeline(schedule, style, pp, tp, microbatches=2, steps=2, layers=2):
    """`Pipeline` against single-process gradient accumulation: {"steps", "params_after", "holders"}."""
    seq2seq = style.get("seq2seq", False)
    depth = dict(num_hidden_layers=layers, num_decoder_layers=layers) if seq2seq else dict(num_hidden_layers=4)
    settings = {"router_type": "gshard", "capacity_factor": 1.0, "moe_layer_frequency": 2, **depth, **style}
    ref, model = build(**settings), build(**settings)
    pipe = Pipeline(model, pp, num_microbatches=microbatches, schedule=schedule, tp=tp)
    stage = pipe.module.model
    # a stage's layers keep their index in the whole model (its attention knows it too)
    stacks = [(n, m) for n, m in stage.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList)]
    assert all(layer.self_attn.layer_idx == i for _, m in stacks for i, layer in enumerate(m) if is_held(layer))
    ref_names = dict(ref.named_parameters())

    def name_of(name):
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
    num_tokens = num_target_tokens(lm_targets(labels, causal=not ref.config.is_encoder_decoder))
    total = 0.0
    for chunk in zip(*(t.chunk(microbatches) for t in (ids, mask, labels))):
        out = ref(input_ids=chunk[0], attention_mask=chunk[1], labels=chunk[2], num_items_in_batch=num_tokens)
        # the model weighs its router losses by the chunk's share of the label tokens; the pipeline takes their mean
        loss = out.lm_loss + router_loss(ref.config, out.aux_loss, out.z_loss) / microbatches
        loss.backward()
        total += loss.item()
    return total
