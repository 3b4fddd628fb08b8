"""Quantized experts: what `from_pretrained(..., quantization_config=BitsAndBytesConfig(...))` gives GPT-MoE, beside
Transformers' Qwen3-MoE under the same calls, in one run. Three parts, protocol fixed before any result:

1. Footprint and decoding, at a shape where experts are at least 97% of the weights (2 layers, hidden 1024, 32
   experts of inner size 1024, top-2, 8 heads / 2 key-value heads, vocab 256), each model saved once in float32 and
   loaded as float32, bfloat16, 8-bit and 4-bit (bitsandbytes: LLM.int8() rows; NF4, double-quantized) and torchao's
   int8 weight-only (`TorchAoConfig(Int8WeightOnlyConfig())`), the non-quantized tensors in bfloat16.
   Footprint: Transformers' `get_memory_footprint()` (parameters and buffers as stored) and the bytes actually held
   (also bitsandbytes' quantization state: 4-bit block scales, which `get_memory_footprint` does not see), each over
   the bfloat16 load's. Decoding: greedy `generate`, batch 1, a 16-token prompt, --new-tokens tokens: the time to the
   first token (the prompt's forward pass) and the decoding rate after it (step times recorded in `generate`); every
   variant once per round in a rotating order after a warm-up round, the median of --rounds rounds reported; the
   tokens of each variant are compared with its float32 model's.
2. Logit error against the dense control: mean |quantized - float32| logit over the float32 logits' standard
   deviation, for a GPT-MoE (Llama layout, 8 experts, top-2) and the same-shape dense Llama (hidden 256, inner 512, 2
   layers, vocab 512), seeds 0, 1, 2 (the same seed builds both); NF4, FP4, int8; the ratio MoE / dense.
3. Held-out loss of a trained MoE before and after quantization: `hf-ppmoe demo`'s protocol (hf_ppmoe.demo.protocol,
   its CPU setting, revision 2: hidden 64, 4 layers, an MoE in every FFN, top-2 of 4 experts of 128; the CPython
   standard library corpus), the `moe_scratch` arm and the `dense` control trained --train-steps steps on seed 0, then
   the held-out LM loss at float32, NF4, FP4, int8.

    python benchmarks/quantization.py --json benchmarks/results/quantization_cpu.json
    python benchmarks/quantization.py --smoke        # seconds: tiny shapes (the test runs it)
    python benchmarks/quantization.py --device cuda --parts footprint --markdown quant.md   # scripts/gpu_check.sh's row
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import bitsandbytes
import torch
import transformers
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessor
from transformers import LogitsProcessorList
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
from hf_ppmoe.moe.quantized import QuantizedExpertsWeight

SHAPE = dict(vocab_size=256, hidden_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
             head_dim=128, num_experts=32, num_experts_per_tok=2, moe_intermediate_size=1024, intermediate_size=1024,
             norm_topk_prob=True, max_position_embeddings=256, pad_token_id=0, tie_word_embeddings=False)
SMOKE_SHAPE = {**SHAPE, "hidden_size": 64, "head_dim": 16, "num_attention_heads": 4, "num_experts": 4,
               "moe_intermediate_size": 64, "intermediate_size": 64}
LOADS = {
    "float32": dict(dtype=torch.float32),
    "bfloat16": dict(dtype=torch.bfloat16),
    "8-bit": dict(dtype=torch.bfloat16, quantization_config=BitsAndBytesConfig(load_in_8bit=True)),
    "4-bit": dict(dtype=torch.bfloat16, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)),
    "int8 torchao": dict(dtype=torch.bfloat16, quantization_config="torchao"),  # TorchAoConfig(Int8WeightOnlyConfig())
}
ERROR_CONFIGS = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "int8": dict(load_in_8bit=True),
}


# ------------------------------------------------------------------------------------- 1. footprint and decoding


def build(name: str, shape: dict):
    torch.manual_seed(0)
    if name == "gpt_moe":
        return GPTMoEForCausalLM(GPTMoEConfig(**shape, moe_layer_frequency=1, router_type="topk"))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, decoder_sparse_step=1, mlp_only_layers=[]))


def expert_share(model) -> float:
    """Share of the weights held by the MoE experts (GPT-MoE's `Experts`, Qwen3-MoE's stacked expert tensors)."""
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return experts / total


def load_kwargs(load: str) -> dict:
    kwargs = dict(LOADS[load])
    if kwargs.get("quantization_config") == "torchao":
        from torchao.quantization import Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        kwargs["quantization_config"] = TorchAoConfig(Int8WeightOnlyConfig())
    return kwargs


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a torchao tensor subclass its inner tensors (values, scales), which its logical shape and
    dtype (what `get_memory_footprint` multiplies) do not tell."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        return sum(tensor_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def held_bytes(model) -> int:
    """Bytes of every parameter and buffer as stored (a torchao tensor's inner tensors), plus bitsandbytes' 4-bit
    quantization state (block scales and their own scales), which lives outside parameters and buffers."""
    total = sum(tensor_bytes(t) for t in (*model.parameters(), *model.buffers()))
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        if state is not None:
            total += sum(v.numel() * v.element_size() for v in state.as_dict().values() if isinstance(v, torch.Tensor))
    return total


def experts_quantized(model) -> bool:
    """Whether the model's expert weights are stored quantized (no plain floating-point expert tensor of 3 dims)."""
    floats = [p for n, p in model.named_parameters()
              if ".experts." in n and p.dim() == 3 and p.is_floating_point() and type(p) is torch.nn.Parameter]
    storages = [m for m in model.modules() if isinstance(m, QuantizedExpertsWeight)]
    return not floats and bool(storages)


class StepTimes(LogitsProcessor):
    """When `generate` has each step's scores: the first after the prompt's forward pass, then one a new token."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def decode(model, new_tokens: int) -> tuple[list[int], float, float]:
    """(tokens, seconds to the first token, decoding tokens/s after it) of one greedy `generate` of `new_tokens`
    tokens from a 16-token prompt: the first step's time is the prompt's forward pass (where quantized experts are
    dequantized whole), the rate is over the steps after it (one token each: the routed experts dequantized)."""
    ids = torch.arange(16, device=model.device).add(1).remainder(SHAPE["vocab_size"]).unsqueeze(0)
    steps = StepTimes()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=None, logits_processor=LogitsProcessorList([steps]))
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    times = steps.times
    return out[0, 16:].tolist(), times[0] - start, (len(times) - 1) / (times[-1] - times[0])


def footprint_and_decoding(args, work: Path) -> list[dict]:
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    models = {}
    for name in ("gpt_moe", "qwen3_moe"):
        model = build(name, shape)
        share = expert_share(model)
        model.save_pretrained(work / name)
        del model
        for load in LOADS:
            models[(name, load)] = AutoModelForCausalLM.from_pretrained(work / name, device_map=args.device, **load_kwargs(load)).eval()
        models[(name, "share")] = share
    variants = [(name, load) for name in ("gpt_moe", "qwen3_moe") for load in LOADS]
    runs = {v: [] for v in variants}
    with torch.no_grad():
        for round_ in range(args.rounds + 1):
            shift = round_ % len(variants)
            for v in variants[shift:] + variants[:shift]:
                result = decode(models[v], args.new_tokens)
                if round_:  # round 0: warm-up
                    runs[v].append(result)
    rows = []
    for name, load in variants:
        model, reference = models[(name, load)], models[(name, "bfloat16")]
        rows.append(dict(
            model=name, load=load, expert_share=models[(name, "share")],
            experts_quantized=experts_quantized(model),
            footprint_bytes=model.get_memory_footprint(), footprint_vs_bf16=model.get_memory_footprint() / reference.get_memory_footprint(),
            held_bytes=held_bytes(model), held_vs_bf16=held_bytes(model) / held_bytes(reference),
            first_token_ms=1000 * statistics.median(r[1] for r in runs[(name, load)]),
            decode_tokens_per_s=statistics.median(r[2] for r in runs[(name, load)]),
            same_tokens_as_float32=runs[(name, load)][0][0] == runs[(name, "float32")][0][0],
        ))
    return rows


# ------------------------------------------------------------------------------------ 2. logit error vs dense


def logit_errors(args, work: Path) -> list[dict]:
    H, I, V = (64, 128, 128) if args.smoke else (256, 512, 512)
    common = dict(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, tie_word_embeddings=False)
    rows = []
    for seed in args.seeds:
        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(**common)).save_pretrained(work / f"dense{seed}")
        torch.manual_seed(seed)
        moe = GPTMoEConfig(**common, num_experts=4 if args.smoke else 8, num_experts_per_tok=2, moe_layer_frequency=1)
        GPTMoEForCausalLM(moe).save_pretrained(work / f"moe{seed}")
        ids = torch.randint(0, V, (4, 64), generator=torch.Generator().manual_seed(100 + seed))
        for name, config in ERROR_CONFIGS.items():
            errors = {}
            for kind in ("dense", "moe"):
                with torch.no_grad():
                    reference = AutoModelForCausalLM.from_pretrained(work / f"{kind}{seed}")(ids).logits
                    quantized = AutoModelForCausalLM.from_pretrained(
                        work / f"{kind}{seed}", quantization_config=BitsAndBytesConfig(**config))(ids).logits
                errors[kind] = ((quantized - reference).abs().mean() / reference.std()).item()
            rows.append(dict(seed=seed, config=name, dense_error=errors["dense"], moe_error=errors["moe"],
                             ratio=errors["moe"] / errors["dense"]))
    return rows


# ------------------------------------------------------------------------------- 3. held-out loss, trained MoE


def held_out_losses(args, work: Path) -> list[dict]:
    import dataclasses

    from hf_ppmoe.demo import loop, protocol

    steps = 8 if args.smoke else args.train_steps
    base = dataclasses.replace(protocol.QUICK, hidden=64) if args.smoke else protocol.CPU  # smoke: whole 64-value blocks
    s = dataclasses.replace(base, steps=steps, eval_every=steps)  # bitsandbytes' CPU 4-bit kernels need the former
    data = protocol.corpus(work / "corpus", s.vocab, s.max_files)
    blocks = loop.held_out_blocks(data, s)
    rows = []
    for arm in ("moe_scratch", "dense"):
        run = loop.Run.start(protocol.build(s, data["tokenizer"], protocol.SCRATCH_ARMS[arm][1], seed=0), s, 0)
        loop.train(run, data, s, s.steps, s.steps, label=arm, verbose=not args.smoke)
        run.model.save_pretrained(work / arm)
        losses = {"float32": loop.evaluate(GPTMoEForCausalLM.from_pretrained(work / arm), blocks, s)}
        for name, config in ERROR_CONFIGS.items():
            quantized = AutoModelForCausalLM.from_pretrained(work / arm, quantization_config=BitsAndBytesConfig(**config))
            losses[name] = loop.evaluate(quantized, blocks, s)
        rows.append(dict(arm=arm, steps=s.steps, tokens=s.tokens(), **losses))
    return rows


# ----------------------------------------------------------------------------------------------------- report


def machine() -> dict:
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), uptime=load, python=platform.python_version(),
                torch=torch.__version__, transformers=transformers.__version__, bitsandbytes=bitsandbytes.__version__,
                peft=version("peft"), trl=version("trl"), cpu_count=os.cpu_count(), threads=torch.get_num_threads())


def version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed(package)
    except PackageNotFoundError:
        return "not installed"


def report(result: dict) -> str:
    lines = []
    if result.get("footprint"):
        lines += ["| model | load | footprint | vs bf16 | bytes held | vs bf16 | experts quantized | first token (ms) | "
                  "decode tokens/s | tokens = float32's |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["footprint"]:
            lines.append(f"| {r['model']} | {r['load']} | {r['footprint_bytes'] / 2**20:.1f} MiB | {r['footprint_vs_bf16']:.3f}x | "
                         f"{r['held_bytes'] / 2**20:.1f} MiB | {r['held_vs_bf16']:.3f}x | {r['experts_quantized']} | "
                         f"{r['first_token_ms']:.0f} | {r['decode_tokens_per_s']:.1f} | {r['same_tokens_as_float32']} |")
    if result.get("logit_error"):
        lines += ["", "| seed | config | dense Llama error | GPT-MoE error | ratio |", "|---|---|---|---|---|"]
        for r in result["logit_error"]:
            lines.append(f"| {r['seed']} | {r['config']} | {r['dense_error']:.4f} | {r['moe_error']:.4f} | {r['ratio']:.2f}x |")
    if result.get("held_out"):
        lines += ["", "| arm | steps | float32 | nf4 | fp4 | int8 |", "|---|---|---|---|---|---|"]
        for r in result["held_out"]:
            lines.append(f"| {r['arm']} | {r['steps']} | {r['float32']:.4f} | {r['nf4']:.4f} | {r['fp4']:.4f} | {r['int8']:.4f} |")
    return "\n".join(lines)


PARTS = {"footprint": footprint_and_decoding, "logit_error": logit_errors, "held_out": held_out_losses}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for part 1 (footprint and decoding)")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path, help="also write the tables there, under a heading")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.new_tokens, args.seeds = 1, 2, [0]
    if args.device != "cpu" and args.parts != ["footprint"]:
        parser.error("--device cuda runs --parts footprint only (the other parts are CPU measurements)")
    torch.set_num_threads(args.threads)
    result = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.parts:
            result[part] = PARTS[part](args, Path(tmp))
    result["machine"]["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown:
        m = result["machine"]
        where = torch.cuda.get_device_name() if args.device == "cuda" else f"{args.device}, {args.threads} thread(s)"
        head = (f"### Quantized experts (benchmarks/quantization.py, {where}; torch {m['torch']}, transformers "
                f"{m['transformers']}, bitsandbytes {m['bitsandbytes']})")
        args.markdown.write_text(f"{head}\n\n{report(result)}\n")
    return result


if __name__ == "__main__":
    main()
