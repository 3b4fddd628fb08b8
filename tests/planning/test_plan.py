"""`hf-ppmoe plan` / `hf_ppmoe.plan` in one process: presets from the data sheets, layouts ranked and rejected with a
reason, the command line and JSON, MODEL as a folder, a config.json or a dense model with upcycle flags (the config
`hf-ppmoe upcycle` writes), LoRA counted as PEFT counts it, flags refused before torch loads. What ranks hold and send
is tests/planning/test_plan_measured.py."""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

import hf_ppmoe
import hf_ppmoe_cli
from hf_ppmoe import GPTMoEConfig, GPTMoEForCausalLM
from hf_ppmoe.planning import GPUS, Cluster, Layout, Run
from hf_ppmoe.planning.communication import collective_time, layer_collectives
from hf_ppmoe.planning.shapes import model_spec
from hf_ppmoe.planning.state import lora_params

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_layer_frequency=2)


def cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = hf_ppmoe_cli.main(["plan", *argv])
        except SystemExit as exit:
            code = exit.code
    return code, out.getvalue(), err.getvalue()


def test_presets_are_the_data_sheets():
    """Dense 16-bit tensor peaks, memory, HBM and NVLink (one direction: half the data sheet's total)."""
    expect = {"V100": (125e12, 32e9, 900e9, 150e9), "A100": (312e12, 80e9, 2039e9, 300e9),
              "H100": (989e12, 80e9, 3350e9, 450e9), "H200": (989e12, 141e9, 4800e9, 450e9)}
    for name, (peak, memory, hbm, nvlink) in expect.items():
        gpu = GPUS[name]
        assert (gpu.peak_flops, gpu.memory, gpu.hbm, gpu.nvlink) == (peak, memory, hbm, nvlink)
        assert 0 < gpu.efficiency < 1 and "data sheet" in gpu.source
    assert Cluster.of("H100", 16).internode == 8 * 400e9 / 8  # 8 x 400 Gb/s per node
    assert Cluster.of("V100", 32).internode == 12.5e9  # the PPMoE paper's 100 Gb/s InfiniBand


def test_plan_ranks_fitting_layouts_and_says_why_the_others_are_rejected():
    result = hf_ppmoe.plan(GPTMoEConfig(**SMALL), gpus=4, gpu="H100", gpu_memory=0.0075, seq_len=256, global_batch=16)
    speeds = [e.time.tokens_per_second for e in result.fitting]
    assert speeds and speeds == sorted(speeds, reverse=True)
    limit = 0.9 * 0.0075e9
    assert all(e.memory.total <= limit for e in result.fitting)
    reasons = {r.layout.name(): r.reason for r in result.rejected}
    assert "does not divide num_key_value_heads=2" in reasons["tp 4"]  # hf_ppmoe.training's own refusal
    assert any("GiB per GPU" in reason for reason in reasons.values())  # too big for 7.5 MB
    names = {e.layout.name() for e in result.fitting} | set(reasons)
    assert len(names) == len(result.fitting) + len(result.rejected)  # every layout once
    best = result.best
    command = best.command("--model_name_or_path M", result.cluster, result.run)
    assert f"--per_device_train_batch_size {best.micro_batch}" in command and best.layout.flags() in command
    assert best.micro_batch * best.microbatches * best.layout.data_parallel == 16  # the global batch


def test_ppmoe_layer_communicates_as_a_dense_ffn_and_all_to_all_crosses_nodes_slower():
    """PPMoE's claim (Sec. 3.3.4) as the planner counts it; an all-to-all's time grows when it leaves the node."""
    spec, run, T = model_spec(GPTMoEConfig(**SMALL)), Run(dtype="bfloat16"), 512
    dense = layer_collectives(spec, Layout(tp=2), run, T, "dense_ffn")
    moe = layer_collectives(spec, Layout(tp=2), run, T, "moe")
    assert sorted(x.bytes for x in moe) == sorted([x.bytes for x in dense] + [T * 2 * 2])  # [T, K] bf16
    a2a = [x for x in layer_collectives(spec, Layout(fsdp=16, ep=16), run, T, "moe") if x.op == "all_to_all_single"]
    one_node, two_nodes = Cluster.of("H100", 16, gpus_per_node=16), Cluster.of("H100", 16)
    assert collective_time(a2a[0], Layout(fsdp=16, ep=16), two_nodes) > collective_time(a2a[0], Layout(fsdp=16, ep=16),
                                                                                          one_node)


def test_lora_adapters_are_counted_as_peft_makes_them():
    from peft import get_peft_model

    from hf_ppmoe.peft import lora_config

    model = GPTMoEForCausalLM(GPTMoEConfig(**SMALL))
    peft_model = get_peft_model(model, lora_config(model, r=4, lora_dropout=0.0))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    spec = model_spec(GPTMoEConfig(**SMALL))
    assert lora_params(spec, Run(lora_rank=4), list(spec.params)) == trainable


def test_cli_plans_a_folder_a_config_and_an_upcycled_dense_model(tmp_path):
    GPTMoEConfig(**SMALL).save_pretrained(tmp_path / "moe")
    code, out, _ = cli(str(tmp_path / "moe"), "--gpus", "2", "--seq_len", "128", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["fitting"] and data["fitting"][0]["command"].startswith("torchrun --nproc-per-node 2 -m hf_ppmoe.training "
                                                                          f"--model_name_or_path {tmp_path / 'moe'}")
    code, out, _ = cli(str(tmp_path / "moe" / "config.json"), "--gpus", "2", "--seq_len", "128")
    assert code == 0 and "Layouts that fit" in out and f"--config_name {tmp_path / 'moe' / 'config.json'}" in out
    # a dense Llama: planned as it is, or as `hf-ppmoe upcycle` would make it (the same config as upcycle's)
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_ppmoe.conversion import upcycle
    from hf_ppmoe.planning import model_config

    dense = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(dense).save_pretrained(tmp_path / "llama")
    planned = model_config(tmp_path / "llama", num_experts=4, router_type="switch")
    made = upcycle(str(tmp_path / "llama"), num_experts=4, router_type="switch").config
    keys = set(GPTMoEConfig().to_dict()) - {"transformers_version", "architectures", "dtype", "conversion", "_name_or_path"}
    assert {k: planned.to_dict()[k] for k in keys} == {k: made.to_dict()[k] for k in keys}
    code, out, _ = cli(str(tmp_path / "llama"), "--gpus", "2", "--seq_len", "128", "--num_experts", "4")
    assert code == 0 and "hf-ppmoe upcycle" in out and "2 MoE (4 experts, top-2)" in out
    code, out, _ = cli(str(tmp_path / "llama"), "--gpus", "2", "--seq_len", "128")
    assert code == 0 and "dense" in out.splitlines()[0]


@pytest.mark.parametrize("argv, flag", [
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "12"], "--gpus 12"),  # not whole nodes of 8
    (["--network", "fast"], "--network"),
    (["--router_type", "switch"], "--num_experts"),
    (["--experts_4bit"], "--lora_rank"),
    (["--gpu", "TPU"], "--gpu"),
])
def test_bad_flags_are_refused_naming_the_flag(tmp_path, argv, flag):
    GPTMoEConfig(**SMALL).save_pretrained(tmp_path)
    code, _, err = cli(str(tmp_path), *argv)
    assert code == 2 and flag in err, err


def test_help_and_flag_errors_come_before_torch(tmp_path):
    code = f"""
import contextlib, io, json, sys, hf_ppmoe_cli
codes = []
for argv in (["plan", "--help"], ["plan", {str(tmp_path / 'missing')!r}], ["plan", {str(tmp_path)!r}, "--gpus", "0"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes.append(hf_ppmoe_cli.main(argv))
        except SystemExit as exit:
            codes.append(exit.code)
print(json.dumps([codes, "torch" in sys.modules]))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [[0, 2, 2], False], result.stderr


def test_four_bit_experts_and_lora_change_what_a_rank_holds():
    """NF4 experts: 0.5 byte per weight and a float32 absmax per 64 (bitsandbytes' layout), frozen with the rest;
    only the adapters take gradients and AdamW state."""
    from hf_ppmoe.planning import Rank
    from hf_ppmoe.planning.state import state_bytes

    spec = model_spec(GPTMoEConfig(**SMALL))
    full = state_bytes(spec, Layout(), Run(dtype="bfloat16"), Rank(0, 0, 0, 0))
    lora = state_bytes(spec, Layout(), Run(dtype="bfloat16", lora_rank=8), Rank(0, 0, 0, 0))
    nf4 = state_bytes(spec, Layout(), Run(dtype="bfloat16", lora_rank=8, experts_4bit=True), Rank(0, 0, 0, 0))
    experts = sum(p.numel for p in spec.params if p.expert)
    adapters = lora_params(spec, Run(lora_rank=8), list(spec.params))
    assert lora["grads"] == nf4["grads"] == 2 * adapters and lora["optimizer"] == 4 * adapters < full["optimizer"]
    assert lora["params"] - nf4["params"] == pytest.approx(experts * (2 - 0.5 - 4 / 64))
