"""Look-alike edits with the shipped demo model: a shape swapped ("circle" -> "triangle") and a direction reversed,
same seed. The default gate reuses both (the look-alike weakness the creator trace found); with
refuse_subject_change on, the gate refuses each and says why. A paraphrase of the same scene is still reused."""
from __future__ import annotations

import pytest

from carnator_engine.backbones.tiny_dit import load_tiny_dit
from carnator_engine.demo import DEMO_GUIDANCE, DEMO_WEIGHTS, world
from carnator_engine.euler import TinyDiTRunner
from carnator_engine.pipeline import CarnatorConfig, decide, generate, lookup, probe
from carnator_engine.schedule import flow_sigmas

SIGMAS = flow_sigmas(20)


@pytest.fixture(scope="module")
def demo_model():
    return load_tiny_dit(DEMO_WEIGHTS, "cpu")


def _decisions(model, store, first, second_prompt, seed):
    """The gate's decision on the second request after the first is stored, with the rule off and on."""
    noise = world.initial_noise([seed])
    generate(TinyDiTRunner(model, first, DEMO_GUIDANCE), noise, SIGMAS, store, CarnatorConfig(block_size=64),
             first, seed).entry_id
    probed = probe(TinyDiTRunner(model, second_prompt, DEMO_GUIDANCE), noise, SIGMAS, CarnatorConfig(block_size=64))
    candidates = lookup(store, probed, CarnatorConfig(block_size=64))
    return {rule: decide(probed, candidates, CarnatorConfig(block_size=64,
                                                            gate_overrides={"refuse_subject_change": rule}))
            for rule in (False, True)}


@pytest.mark.parametrize("pair", [0, 1], ids=["shape swap", "direction reversed"])
def test_look_alike_edits_are_refused_with_the_subject_rule(demo_model, store, pair):
    first, second = world.adversarial_pairs(2, seed=7, kinds=("shape", "direction"))[pair]
    decisions = _decisions(demo_model, store, first.prompt, second.prompt, first.seed)
    assert decisions[False].reuse, "the default gate no longer reuses this look-alike pair: pick another example"
    refused = decisions[True]
    assert not refused.reuse
    assert any(reason.startswith("subject change: ") for reason in refused.reasons), refused.reasons


def test_a_paraphrase_is_still_reused_with_the_subject_rule(demo_model, store):
    scene = world.adversarial_pairs(1, seed=7, kinds=("shape",))[0][0]
    a = scene.attributes
    reworded = (f"a {a['color']} {a['size']} {a['shape']} moving {a['direction']} {world.SPEED_ADVERB[a['speed']]} "
                f"on a {a['background']} background")
    decisions = _decisions(demo_model, store, scene.prompt, reworded, scene.seed)
    assert decisions[True].reuse and decisions[True].resume_step > 3
