"""A batch whose labels hold no target (all -100; for GPT-MoE also one-token sequences, where no token has an earlier
one to be predicted from) has a finite loss of 0 and gives no gradient, in both families, with and without
Transformers' `num_items_in_batch`; batches with targets keep their loss."""

import pytest
import torch
from helpers import tiny_gpt_config, tiny_seq2seq_config

from hf_ppmoe import GPTMoEForCausalLM, Seq2SeqMoEForConditionalGeneration

FAMILIES = {
    "gpt": lambda: GPTMoEForCausalLM(tiny_gpt_config(router_aux_loss_coef=0.5, router_z_loss_coef=0.5)),
    "seq2seq": lambda: Seq2SeqMoEForConditionalGeneration(tiny_seq2seq_config(router_aux_loss_coef=0.5,
                                                                              router_z_loss_coef=0.5)),
}


def batches(family):
    ids = torch.randint(3, 97, (2, 5))
    none = dict(input_ids=ids, labels=torch.full_like(ids, -100))
    if family == "gpt":
        return {"all -100": none, "one token": dict(input_ids=ids[:, :1], labels=ids[:, :1])}
    return {"all -100": dict(none, decoder_input_ids=ids)}


@pytest.mark.parametrize("num_items_in_batch", [None, 0, 7], ids=["plain", "no target in the step", "Trainer share"])
@pytest.mark.parametrize("family", FAMILIES)
def test_no_target_batch_has_loss_zero_and_no_gradient(family, num_items_in_batch):
    model = FAMILIES[family]().train()
    extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
    for name, inputs in batches(family).items():
        model.zero_grad()
        with pytest.warns(UserWarning, match="No label in this batch is a target"):
            out = model(**inputs, **extra)
        assert out.aux_loss is not None and out.aux_loss > 0  # the router losses were computed, and weigh 0
        assert out.loss == 0, name
        out.loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.equal(g, torch.zeros_like(g)) for g in grads), name


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_with_one_target_keeps_its_loss(family):
    """The zero applies to empty batches only: one target token gives the usual LM loss plus router terms."""
    model = FAMILIES[family]().eval()
    inputs = batches(family)["all -100"]
    inputs["labels"][0, -1] = 5
    out = model(**inputs)
    logits = out.logits[0, -2] if family == "gpt" else out.logits[0, -1]  # GPT: token t + 1 predicted at t
    lm = torch.nn.functional.cross_entropy(logits[None], torch.tensor([5]))
    torch.testing.assert_close(out.loss, lm + 0.5 * out.aux_loss + 0.5 * out.z_loss)
