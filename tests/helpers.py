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
