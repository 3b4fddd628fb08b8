"""Resuming a tensor- or pipeline-parallel run reads torch.distributed.checkpoint files (`load_sharded`): a crafted
`.metadata` or a crafted non-tensor entry must be refused without running its code, as Accelerate's weights_only
loading refuses it in the single-process checkpoint; what the training writes must still load exactly."""

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import tiny_gpt_config

from hf_ppmoe import GPTMoEForCausalLM
from hf_ppmoe.parallel.checkpoint import UntrustedCheckpointError
from hf_ppmoe.training.checkpoints import load_sharded, sharded_state


class Payload:
    """Unpickling this writes a file: the proof that loading ran code from the checkpoint."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _trained():
    torch.manual_seed(0)
    model = GPTMoEForCausalLM(tiny_gpt_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ids = torch.randint(3, 97, (2, 8))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


def _fresh():
    torch.manual_seed(1)
    model = GPTMoEForCausalLM(tiny_gpt_config())
    return model, torch.optim.AdamW(model.parameters(), lr=5e-2)


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that no process group is initialised
def test_sharded_checkpoint_loads_exactly_and_crafted_ones_are_refused(tmp_path):
    model, optimizer = _trained()
    dcp.save(sharded_state(model, optimizer), checkpoint_id=tmp_path / "good")
    loaded, loaded_optimizer = _fresh()
    load_sharded(tmp_path / "good", loaded, loaded_optimizer)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert loaded_optimizer.param_groups[0]["lr"] == 1e-3 and loaded_optimizer.param_groups[0]["weight_decay"] == 0.1
    for state, loaded_state in zip(optimizer.state.values(), loaded_optimizer.state.values()):
        assert all(torch.equal(state[k], loaded_state[k]) for k in ("exp_avg", "exp_avg_sq", "step"))

    # a .metadata whose unpickling runs code
    marker = tmp_path / "ran-from-metadata"
    dcp.save(sharded_state(model, optimizer), checkpoint_id=tmp_path / "metadata")
    (tmp_path / "metadata" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UntrustedCheckpointError, match=r"\.metadata: refusing to unpickle builtins\.exec"):
        load_sharded(tmp_path / "metadata", *_fresh())
    assert not marker.exists()

    # an optimizer hyper-parameter (stored as pickled bytes) whose unpickling runs code
    marker = tmp_path / "ran-from-entry"
    optimizer.param_groups[0]["lr"] = Payload(marker)
    dcp.save(sharded_state(model, optimizer), checkpoint_id=tmp_path / "entry")
    with pytest.raises(UntrustedCheckpointError, match=r"refusing to unpickle entry optimizer\.param_groups\.0\.lr"):
        load_sharded(tmp_path / "entry", *_fresh())
    assert not marker.exists()
