"""`QuantizedBlockStates` when two caches interleave their steps layer by layer (a packed serving step): a block
encoded by one cache's step keeps its stage until every layer of the store wrote it, even when the other cache's
step begins in between."""

import torch

from hf_pagedkv.storage.quantized_block_states import QuantizedBlockStates
from hf_pagedkv.storage.staging_store import StagingStore

B = 4
LAYERS = 2


def states() -> QuantizedBlockStates:
    s = QuantizedBlockStates(B, 0, StagingStore(B), StagingStore(B))
    s.grow(8)
    return s


def test_a_block_encoded_mid_step_keeps_its_stage_until_every_layer_wrote_it():
    s = states()
    # cache A's first step: 3 tokens into block 0 (opened: a stage), cache B's: 2 tokens into block 4
    s.plan(torch.tensor([0, 1, 2]), torch.device("cpu"), num_layers=LAYERS)
    s.plan(torch.tensor([16, 17]), torch.device("cpu"), num_layers=LAYERS)
    stage_a = s.stage_of[0]
    # next packed step: A's 4th token fills block 0 (encoded now, from its stage, in every layer)
    plan, _ = s.plan(torch.tensor([3]), torch.device("cpu"), num_layers=LAYERS)
    assert plan.done_ids == (0,) and plan.prefix_stage.tolist() == [stage_a]
    s.note_encoded(plan.done_ids, 0)  # A's layer 0 encoded block 0
    # B's step begins (layer 0) before A's layer 1 wrote: A's stage stays
    s.plan(torch.tensor([18]), torch.device("cpu"), num_layers=LAYERS)
    assert s.stage_of[0] == stage_a and 0 in s.pending
    s.note_encoded(plan.done_ids, 1)  # A's layer 1 encodes block 0 from the stage, still A's
    # the next packed step: every layer wrote block 0, its stage goes back
    s.plan(torch.tensor([4]), torch.device("cpu"), num_layers=LAYERS)
    assert 0 not in s.stage_of and 0 not in s.pending and s.encoded[0] == 1
    assert s.check(live={0, 1, 4}) == []
    assert s.staging.num_used == 2  # B's block 4 and A's new block 1


def test_one_cache_releases_at_its_next_step_as_before():
    s = states()
    plan, _ = s.plan(torch.tensor([0, 1, 2, 3, 4]), torch.device("cpu"), num_layers=LAYERS)
    assert plan.done_ids == (0,)  # a prefill fills block 0 directly: no stage for it
    s.note_encoded(plan.done_ids, 0)
    s.note_encoded(plan.done_ids, 1)
    plan, _ = s.plan(torch.tensor([5, 6, 7]), torch.device("cpu"), num_layers=LAYERS)  # fills block 1 (staged)
    stage = s.stage_of[1]
    for layer in range(LAYERS):
        s.note_encoded(plan.done_ids, layer)
    assert s.stage_of[1] == stage  # until the next step begins
    s.plan(torch.tensor([8]), torch.device("cpu"), num_layers=LAYERS)
    assert 1 not in s.stage_of and s.num_encodes[1] == 1
