"""Issue 31 item 4: `import hf_ppmoe` is light (submodules load on first use; the Auto classes learn our models when
Transformers loads them) and still registers our models with the Auto classes; `hf-ppmoe train|demo --help` and
their flag errors, and those of the conversion commands, come before torch is imported. Run in fresh interpreters: this process has imported everything already."""

import json
import os
import subprocess
import sys

HEAVY = ("torch", "transformers", "torch.distributed.tensor", "transformers.modeling_utils", "hf_ppmoe.modeling", "hf_ppmoe.moe",
         "hf_ppmoe.parallel", "hf_ppmoe.modeling.modeling_gpt_moe", "datasets", "matplotlib", "accelerate")


def _python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_import_hf_ppmoe_imports_no_heavy_module():
    loaded = json.loads(_python(f"import sys, json, hf_ppmoe; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"))
    assert loaded == []


def test_auto_classes_resolve_our_models_after_a_bare_import(tmp_path):
    code = f"""
import hf_ppmoe, json, sys
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM
small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_experts=2, num_experts_per_tok=1)
hf_ppmoe.GPTMoEConfig(**small).save_pretrained({str(tmp_path)!r})
config = AutoConfig.from_pretrained({str(tmp_path)!r})  # by model_type, no class touched before
names = [type(config).__name__, type(AutoModelForCausalLM.from_config(config)).__name__,
         type(AutoModel.from_config(config)).__name__,
         type(AutoModelForSeq2SeqLM.from_config(hf_ppmoe.Seq2SeqMoEConfig(vocab_size=64, d_model=32, d_ff=64, num_layers=2,
              num_heads=2, d_kv=16, num_experts=2))).__name__]
# the table of model types matches the classes; every public name of DESIGN.md imports; plan styles registered
from hf_ppmoe import GPTMoEConfig, GPTMoEModel, GPTMoEForCausalLM, Seq2SeqMoEConfig, Seq2SeqMoEModel, Seq2SeqMoEForConditionalGeneration
from hf_ppmoe.moe import Routing, Gate, register_gate, MoELayer
from hf_ppmoe.conversion import upcycle, merge_experts
from hf_ppmoe.generation import flat_beam_search
for model_type, (config_name, models) in hf_ppmoe._MODELS.items():
    assert getattr(hf_ppmoe, config_name).model_type == model_type
    assert all(getattr(hf_ppmoe, m).config_class is getattr(hf_ppmoe, config_name) for m in models.values())
assert "hf_ppmoe.parallel" in sys.modules and set(hf_ppmoe.__all__) <= set(dir(hf_ppmoe))
print(json.dumps(names))
"""
    assert json.loads(_python(code)) == ["GPTMoEConfig", "GPTMoEForCausalLM", "GPTMoEModel",
                                         "Seq2SeqMoEForConditionalGeneration"]


def test_the_classes_still_register_where_the_auto_tables_differ():
    code = """
import hf_ppmoe, sys, json
from transformers import AutoConfig, AutoModelForCausalLM
hf_ppmoe._register_classes()  # the fallback: Transformers' public register API
config = AutoConfig.for_model("gpt_moe", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_experts=2, num_experts_per_tok=1)
print(json.dumps(type(AutoModelForCausalLM.from_config(config)).__name__))
"""
    assert json.loads(_python(code)) == "GPTMoEForCausalLM"


def test_models_register_also_when_the_auto_classes_were_imported_first(tmp_path):
    code = """
from transformers import AutoConfig, AutoModelForCausalLM
import hf_ppmoe, json
config = AutoConfig.for_model("gpt_moe", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_experts=2, num_experts_per_tok=1)
print(json.dumps(type(AutoModelForCausalLM.from_config(config)).__name__))
"""
    assert json.loads(_python(code)) == "GPTMoEForCausalLM"


def test_every_command_help_and_flag_errors_come_before_torch(tmp_path):
    (tmp_path / "file").write_text("")
    file, missing = str(tmp_path / "file"), str(tmp_path / "missing")
    code = f"""
import json, sys, contextlib, io, hf_ppmoe_cli
codes = []
for argv in (["train", "--help"], ["train", "--output_dir", {file!r}], ["train", "--no_such_flag"],
             ["demo", "--help"], ["demo", "--output_dir", {file!r}], ["demo", "--seeds", "0"],
             ["upcycle", "--help"], ["upcycle", {missing!r}, "out", "--num_experts", "x"], ["merge", "--help"],
             ["merge", {missing!r}, "out"], ["import", "--help"], ["export", "--help"],
             ["export", {missing!r}, "out", "--to", "nothing"], ["megatron", "--help"], ["megatron", "to-hf", "--help"],
             ["megatron", "to-megatron", {missing!r}, "out"], ["serve", "--help"], ["serve"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes.append(hf_ppmoe_cli.main(argv))
        except SystemExit as exit:
            codes.append(exit.code)
print(json.dumps([codes, "torch" in sys.modules]))
"""
    assert json.loads(_python(code)) == [[0, 2, 2, 0, 2, 2, 0, 2, 0, 2, 0, 0, 2, 0, 0, 2, 0, 2], False]
