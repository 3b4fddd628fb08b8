"""Megatron-LM for GPT-MoE, in one package (GPU-only at training time; the CPU tests run what can run):

    plugin.py     Accelerate's Megatron-LM backend: the "gpt_moe" config parser, a model provider building a
                  megatron-core GPTModel whose MoE layers are PPMoE layers, and a train step (imported on its own:
                  `import hf_ppmoe.megatron.plugin` registers the parser)
    weights.py    GPT-MoE <-> Megatron-LM checkpoints (TP x PP shards, experts on the tensor-parallel group), through
                  conversion/mapping.py's tables
    __main__.py   `hf-ppmoe megatron to-megatron|to-hf` (also `python -m hf_ppmoe.megatron`)

Nothing is imported here: the plugin needs Accelerate's Megatron machinery, the weights need torch. docs/megatron.md
has the how-to and the name tables.
"""
