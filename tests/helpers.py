import torch


def tiny_gpt_config(**overrides):
    from hf_ppmoe import GPTMoEConfig

    kwargs = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_layer_frequency=1,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    kwargs.update(overrides)
    return GPTMoEConfig(**kwargs)


GPT2_STYLE = dict(
    position_embedding_type="learned",
    norm_type="layernorm",
    layer_norm_eps=1e-5,
    gated_mlp=False,
    hidden_act="gelu_new",
    attention_bias=True,
    mlp_bias=True,
    tie_word_embeddings=True,
    num_key_value_heads=4,
)


def tiny_seq2seq_config(**overrides):
    from hf_ppmoe import Seq2SeqMoEConfig

    kwargs = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_decoder_layers=2,
        num_attention_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_layer_frequency=1,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    kwargs.update(overrides)
    return Seq2SeqMoEConfig(**kwargs)


def trainer_rows(family, labels_padded=True, n=4, length=8, seed=0):
    """`n` training examples for Transformers' Trainer (dicts of input_ids and labels) for the "gpt" or "seq2seq"
    family; with `labels_padded`, rows 0 and 3 have fewer label tokens (-100 after a few)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (n, length), generator=g)
    labels = ids.clone()
    if labels_padded:
        labels[0, 5:] = -100
        labels[3, 2:] = -100
    inputs = ids if family == "gpt" else torch.randint(3, 97, (n, length + 2), generator=g)
    return [{"input_ids": i, "labels": l} for i, l in zip(inputs, labels)]


def stack_rows(examples):
    return {key: torch.stack([e[key] for e in examples]) for key in examples[0]}


def trainer_args(out, **overrides):
    """Trainer arguments for a quick CPU run: one step, logged, in order, nothing saved or reported (Seq2Seq's, which
    Trainer takes too)."""
    from transformers import Seq2SeqTrainingArguments

    values = dict(
        output_dir=str(out), max_steps=1, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, train_sampling_strategy="sequential", dataloader_num_workers=0,
    )
    values.update(overrides)
    return Seq2SeqTrainingArguments(**values)
