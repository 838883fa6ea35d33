"""Region-only resume with the cached sparse connectivity (CarnatorConfig.region_sparse_keys): a region step's target
attends only to the key blocks its query blocks reach in each block's table, so only those keys are kept, moved and
attended to. A table that reaches every block gives today's region-only result; a sparse one gives exactly the
attention masked to the reached blocks; the kept and streamed bytes shrink by the unreached rows; off, nothing
changes. Every backbone's tiny model: tests/host/test_region_host.py."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from carnator_engine import kept_kv
from carnator_engine import resume as resume_stage
from carnator_engine.attention.connectivity import BLOCK_SIZE_KEY, reached_key_rows
from carnator_engine.attention.sparse import BlockSparseAttention, token_blocks_from_mask
from carnator_engine.kept_kv import KeptKeysValues, MemoryReading
from carnator_engine.observer import GenerationObserver
from carnator_engine.pipeline import CarnatorConfig
from carnator_engine.region import RegionTokens, latent_mask_of_tokens
from test_kept_kv import FakeMemory
from test_region_resume import _hit

BLOCK = 16      # tokens per block of the crafted tables: 4 blocks a frame of the tiny DiT's 8 x 8 tokens


def sink_tables(blocks: int, layers, block_size: int = BLOCK) -> dict:
    """Stored connectivity in which every query block reaches key block 0 and itself: a target reaches its own
    blocks and the first."""
    table = torch.eye(blocks, dtype=torch.bool)
    table[:, 0] = True
    return {**{str(layer): table.clone() for layer in layers}, BLOCK_SIZE_KEY: torch.tensor(block_size)}


def reference_plan(reach: dict, target: torch.Tensor, block_size: int) -> BlockSparseAttention:
    """A whole-clip attention in which the target's query blocks attend to the key blocks they reach and every other
    query block to every key: its target rows are what a region step's must give."""
    query_blocks = token_blocks_from_mask(target, block_size)
    blocks = int(query_blocks.numel())
    tables = {}
    for layer, rows in reach.items():
        table = torch.ones(blocks, blocks, dtype=torch.bool)
        table[query_blocks] = token_blocks_from_mask(
            torch.zeros(target.numel(), dtype=torch.bool).index_fill(0, rows, True), block_size)
        tables[layer] = table
    return BlockSparseAttention(tables, block_size=block_size)


def test_the_target_reaches_the_key_blocks_of_its_query_blocks_rows_and_its_own():
    target = torch.zeros(10, dtype=torch.bool)
    target[[4, 5]] = True                                          # query block 2 of blocks of 2 tokens
    table = torch.zeros(5, 5, dtype=torch.bool)
    table[2, 4] = True
    table[0, 1] = True                                             # a row the target does not hold: not reached
    every, other_size = torch.ones(5, 5, dtype=torch.bool), torch.ones(3, 3, dtype=torch.bool)
    rows = reached_key_rows({"0": table, "1": every, "2": other_size, BLOCK_SIZE_KEY: torch.tensor(2)}, target)
    assert rows[0].tolist() == [4, 5, 8, 9]
    assert rows[1] is None and 2 not in rows                       # every block reached; a table of other tokens


def _captured(region, block, q, k, v):
    region.begin_step(0)
    region.forward()
    region.attention_inputs(block, q, k, v)
    region.begin_step(1)
    region.forward()


@pytest.mark.parametrize("text", [0, 3])
def test_a_region_steps_attention_is_the_attention_masked_to_the_reached_blocks(text):
    """Target queries over the reached video keys (and a joint model's text keys); text queries over every key."""
    torch.manual_seed(0)
    length, size = 24, 4
    target = torch.zeros(length, dtype=torch.bool)
    target[[9, 10, 17]] = True                                     # query blocks 2 and 4
    table = torch.zeros(6, 6, dtype=torch.bool)
    table[2, 0] = table[4, 5] = table[1, 3] = True                 # block 3 is reached by a row outside the target
    rows = reached_key_rows({"0": table, BLOCK_SIZE_KEY: torch.tensor(size)}, target)[0]
    assert rows.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 20, 21, 22, 23]
    q, k, v = (torch.randn(2, 2, length + text, 8) for _ in range(3))
    region = RegionTokens(target, frozenset({0}), reach={0: rows})
    _captured(region, 0, q, k, v)
    kept = target.nonzero().flatten()
    step = torch.cat([kept, torch.arange(length, length + text)])
    q2, k2, v2 = (t.index_select(2, step) + 1 for t in (q, k, v))   # this step's own rows
    dense_calls = []

    def dense(a, b, c):
        dense_calls.append(int(b.shape[2]))
        return F.scaled_dot_product_attention(a, b, c)
    out = region.attend(0, q2, k2, v2, dense)
    keys, values = k.clone(), v.clone()
    keys[:, :, step], values[:, :, step] = k2, v2
    allowed = torch.zeros(len(step), length + text, dtype=torch.bool)
    allowed[:, rows] = True
    allowed[:, length:] = True                                     # the text keys stay in view
    allowed[len(kept):] = True                                     # text queries attend to every key
    expected = F.scaled_dot_product_attention(q2, keys, values, attn_mask=allowed)
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5)
    assert dense_calls == ([len(rows)] if not text else [len(rows) + text, length + text])
    held = region.keys_values.fetch((0, 0))[0]
    assert held.shape[2] == (len(rows) if not text else length + text)    # without text rows: the reached rows alone


def _crafted_hit(live_tiny_model, store, **kwargs):
    """A region-only hit whose entry's connectivity is sink_tables: (runner, probed, decision, payload, config)."""
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0, **kwargs)
    payload = store.trajectory(store.record(decision.entry_id))
    tokens = 8 * 8 * 8
    tables = sink_tables(tokens // BLOCK, range(len(live_tiny_model.blocks)))
    payload = dataclasses.replace(payload, connectivity=tables)
    return runner, probed, decision, payload, config


def _region_hit(runner, probed, decision, payload, config):
    decision, region, _ = resume_stage.plan_region(runner, probed, decision, payload, config)
    assert decision.numbers["region_only"]
    latent = resume_stage.follow_entry(runner, probed, decision, payload, config, GenerationObserver(), region)
    assert not region.fallback and not region.missing
    return latent, region, decision


def test_a_table_that_reaches_every_block_gives_todays_region_only_result(live_tiny_model, store):
    runner, probed, decision, payload, config = _crafted_hit(live_tiny_model, store)
    every = {**{name: torch.ones_like(t) for name, t in payload.connectivity.items() if name != BLOCK_SIZE_KEY},
             BLOCK_SIZE_KEY: payload.connectivity[BLOCK_SIZE_KEY]}
    payload = dataclasses.replace(payload, connectivity=every)     # the full steps attend as densely both times
    today, region, _ = _region_hit(runner, probed, decision, payload, config)
    assert not region.reach
    sparse_config = dataclasses.replace(config, region_sparse_keys=True)
    latent, region, d = _region_hit(runner, probed, decision, payload, sparse_config)
    assert region.reach and all(rows is None for rows in region.reach.values())
    assert d.numbers["region_key_share"] == 1.0
    assert torch.allclose(latent, today, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_with_a_sparse_table_a_region_step_gives_the_target_the_masked_full_steps_result(live_tiny_model, store,
                                                                                         guidance):
    """One step run twice from the same latent: every token under the reference plan (capturing the keys and values
    the target reaches), then the target alone with its keys cut to the reached blocks: the same target region."""
    runner, probed, decision, payload, config = _crafted_hit(live_tiny_model, store, guidance=guidance)
    decision, _, _ = resume_stage.plan_region(runner, probed, decision, payload, config)
    cells = resume_stage.region_latent_cells(decision, probed.latent.shape[-3:], config.region_target_mass)
    target = resume_stage.target_tokens(runner.layout, cells, resume_stage.REGION_HALO)
    reach = reached_key_rows(payload.connectivity, target)
    assert all(0 < len(rows) < target.numel() for rows in reach.values())
    step = decision.resume_step
    x = torch.randn(probed.latent.shape, generator=torch.Generator().manual_seed(3)) * float(probed.sigmas[step])
    region = RegionTokens(target, frozenset({step}), reach=reach)
    full = runner.run(x, probed.sigmas, step, step + 1,
                      GenerationObserver(region=region, sparse=reference_plan(reach, target, BLOCK)))
    region.full_steps = frozenset()
    part = runner.run(x, probed.sigmas, step, step + 1, GenerationObserver(region=region))
    assert region.active and not region.missing
    assert all(held[0].shape[2] == len(reach[key[0]]) for key, held in region.keys_values._held.items())
    inside = latent_mask_of_tokens(runner.layout, target, x.shape[-3:])
    assert torch.allclose(part[..., inside], full[..., inside], rtol=1e-4, atol=1e-5)


def test_the_kept_and_streamed_keys_shrink_by_the_rows_the_target_does_not_reach(live_tiny_model, store, monkeypatch):
    runner, probed, decision, payload, config = _crafted_hit(live_tiny_model, store)
    monkeypatch.setattr(kept_kv, "placement", lambda order, *args: (set(), ""))     # every block streamed
    runner.memory = FakeMemory(reading=MemoryReading(0, 0, 0))
    loaded = []
    original = KeptKeysValues._load

    def load(self, key, index):
        loaded.append(sum(t.numel() * t.element_size() for t in self._held[key]))
        return original(self, key, index)
    monkeypatch.setattr(KeptKeysValues, "_load", load)

    def moved(config):
        loaded.clear()
        _, region, d = _region_hit(runner, probed, decision, payload, config)
        return region.keys_values.placed, sum(loaded), region, d
    dense_placed, dense_loaded, _, _ = moved(config)
    sparse_placed, sparse_loaded, region, d = moved(dataclasses.replace(config, region_sparse_keys=True))
    length = region.length
    reached = {len(rows) for rows in region.reach.values()}
    assert len(reached) == 1 and dense_placed["resident"] == sparse_placed["resident"] == 0
    share = reached.pop()
    assert 0 < share < length and d.numbers["region_key_share"] == pytest.approx(share / length, abs=1e-4)
    assert sparse_placed["streamed"] * length == dense_placed["streamed"] * share    # the unreached rows never kept
    assert sparse_loaded * length == dense_loaded * share > 0                       # nor moved at any region step


def test_without_a_connectivity_or_sparse_attention_the_target_attends_to_every_key(live_tiny_model, store):
    runner, probed, decision, payload, config = _crafted_hit(live_tiny_model, store)
    for entry, sparse in ((dataclasses.replace(payload, connectivity={}), True), (payload, False)):
        on = dataclasses.replace(config, region_sparse_keys=True, sparse_attention=sparse)
        _, region, d = _region_hit(runner, probed, decision, entry, on)
        assert not region.reach and "region_key_share" not in d.numbers


def test_the_sparse_keys_setting_is_validated_with_the_fix():
    with pytest.raises(ValueError, match="region_sparse_keys must be True or False"):
        CarnatorConfig(region_sparse_keys="yes").validate(10)
