"""Model and tokenizer building for `python -m hf_ppmoe.training`: which family the run trains (`is_seq2seq`), its
tokenizer (`load_tokenizer`: the model's, --tokenizer_name's, or one fitted to the training text) and its model
(`build_model`: loaded, from a config, upcycled from a dense checkpoint, or the default small GPT-MoE)."""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from ..modeling import GPTMoEConfig, GPTMoEForCausalLM
from .arguments import TrainArguments
from .data import Source, train_tokenizer

TOKENIZER_TRAINING_CHARACTERS = 20_000_000  # a tokenizer trained for a model from scratch reads this much text


def is_seq2seq(args: TrainArguments) -> bool:
    """Whether the model to train is an encoder-decoder (then the data are (source, target) pairs: pairs.py)."""
    source = args.model_name_or_path or args.config_name or args.upcycle_from
    return bool(source) and bool(getattr(AutoConfig.from_pretrained(source), "is_encoder_decoder", False))


def load_tokenizer(args: TrainArguments, texts=None):
    """The model's (or --tokenizer_name's) tokenizer; for a model trained from scratch a BPE tokenizer fitted to
    `texts`, by default the first documents of the training data."""
    source = args.tokenizer_name or args.model_name_or_path or args.upcycle_from
    if source:
        try:
            return AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError):
            if args.tokenizer_name:
                raise
    if texts is not None:
        return train_tokenizer(texts)
    train = Source.of(args)

    def documents():
        characters = 0
        for batch in train.texts():
            for text in batch:
                yield text
                characters += len(text)
                if characters >= TOKENIZER_TRAINING_CHARACTERS:
                    return

    return train_tokenizer(documents())


def build_model(args: TrainArguments, tokenizer):
    """Our GPT-MoE (loaded, from a config, upcycled, or the default small one), or any Transformers causal LM (a
    dense baseline trained by the same script; it simply has no router metrics)."""
    seq2seq = is_seq2seq(args)
    auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    if args.model_name_or_path:
        model = auto.from_pretrained(args.model_name_or_path)
    elif args.upcycle_from:
        from ..conversion import upcycle

        model = upcycle(
            args.upcycle_from,
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            router_type=args.router_type,
            router_init=args.router_init,
            noise_std=args.noise_std,
            seed=args.seed,
        )
    elif args.config_name:  # any causal-LM or seq2seq config.json (model_type decides the class), the tokenizer's ids
        config = AutoConfig.from_pretrained(args.config_name)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            setattr(config, name, getattr(tokenizer, name))
        if seq2seq:
            config.decoder_start_token_id = tokenizer.pad_token_id  # T5's convention
        model = auto.from_config(config)
    else:
        model = GPTMoEForCausalLM(
            GPTMoEConfig(
                vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=4, max_position_embeddings=max(512, args.block_size),
                num_experts=args.num_experts, num_experts_per_tok=args.num_experts_per_tok, router_type=args.router_type,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
            )
        )
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {model.config.vocab_size}; "
            "use the model's own tokenizer (--tokenizer_name) or resize the embeddings first."
        )
    return model
