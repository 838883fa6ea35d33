import re

import torch

from carnator_engine.demo import world
from carnator_engine.demo.world import ATTRIBUTES, VALUES, VOCABULARY


def _clips(n=320, seed=0):
    generator = torch.Generator().manual_seed(seed)
    codes = world.sample_codes(n, generator)
    return world.decode(codes), world.render_codes(codes, generator)


def test_analyzer_reads_back_every_attribute_of_rendered_clips():
    expected, clips = _clips()
    scores = world.attribute_accuracy(expected, world.analyze_batch(clips))
    for name in ATTRIBUTES:
        assert scores[name] >= 0.98, (name, scores)
    # Every value of every attribute was drawn, so no attribute passes by always answering one thing.
    for name in ATTRIBUTES:
        assert {e[name] for e in expected} == set(VALUES[name])


def test_analyzer_tolerates_generation_noise():
    expected, clips = _clips(160, seed=1)
    noisy = clips + 0.1 * torch.randn(clips.shape, generator=torch.Generator().manual_seed(2))
    scores = world.attribute_accuracy(expected, world.analyze_batch(noisy))
    assert min(scores[name] for name in ATTRIBUTES) >= 0.95, scores


def test_prompts_use_only_vocabulary_words_and_parse_back():
    vocabulary = set(VOCABULARY)
    combinations = world.all_combinations()
    assert len(combinations) == 6 * 3 * 4 * 3 * 2 * 2
    used = set()
    for attributes in combinations:
        text = world.prompt(attributes)
        words = re.findall(r"[a-z]+", text)
        assert set(words) <= vocabulary, text
        assert len(words) <= 16, text   # TinyDiTConfig.text_len
        used |= set(words)
        assert world.parse_prompt(text) == attributes
    assert used == vocabulary
    # Distinct requests have distinct prompts.
    assert len({world.prompt(a) for a in combinations}) == len(combinations)


def test_render_is_seeded_in_range_and_keeps_the_object_in_frame():
    attributes = {"color": "yellow", "shape": "square", "direction": "right", "background": "white",
                  "size": "large", "speed": "fast"}
    a, b = world.render(attributes, seed=5), world.render(attributes, seed=5)
    assert a.shape == world.CLIP_SHAPE and torch.equal(a, b)
    assert not torch.equal(a, world.render(attributes, seed=6))
    assert a.min() >= -1 and a.max() <= 1
    _, clips = _clips(200, seed=3)
    border = torch.cat([clips[..., 0, :], clips[..., -1, :], clips[..., :, 0], clips[..., :, -1]], dim=-1)
    assert torch.equal(border.amin(-1), border.amax(-1)), "an object reached the border"


def test_blank_clip_has_no_object():
    read = world.analyze(torch.full(world.CLIP_SHAPE, -1.0))
    assert read["background"] == "black"
    assert all(read[name] is None for name in ATTRIBUTES if name != "background")


def test_heldout_sampling():
    generator = torch.Generator().manual_seed(0)
    assert not world.heldout_mask(world.sample_codes(2000, generator, heldout="exclude")).any()
    only = world.sample_codes(200, generator, heldout="only")
    assert world.heldout_mask(only).all()
    assert all(world.is_heldout(a) for a in world.decode(only))


def test_iteration_stream_edits_one_attribute_at_a_time():
    stream = world.iteration_stream(40, seed=3)
    assert stream == world.iteration_stream(40, seed=3)
    assert stream[0].edited is None
    for before, after in zip(stream, stream[1:]):
        changed = [n for n in ATTRIBUTES if before.attributes[n] != after.attributes[n]]
        assert changed == [after.edited]
        assert after.seed != before.seed
    restarted = world.iteration_stream(10, seed=3, restart_every=5)
    assert restarted[5].edited is None
    fixed = world.iteration_stream(10, seed=3, restart_every=5, one_seed_per_session=True)
    assert [r.attributes for r in fixed] == [r.attributes for r in restarted]   # same prompts, seeds per session
    assert [r.seed for r in fixed] == [restarted[0].seed] * 5 + [restarted[5].seed] * 5


def test_made_wrong_counts_only_what_the_reference_got_right():
    expected = {name: world.VALUES[name][0] for name in ATTRIBUTES}
    reference = {**expected, "shape": world.VALUES["shape"][1]}            # the full generation missed the shape
    read = {**expected, "shape": world.VALUES["shape"][1], "color": world.VALUES["color"][1]}
    assert world.made_wrong(read, reference, expected) == ["color"]
    assert world.all_right(expected, expected) and not world.all_right(read, expected)


def test_adversarial_pairs_differ_in_one_word_and_share_noise():
    pairs = world.adversarial_pairs(12, seed=1)
    kinds = [first.tags["kind"] for first, _ in pairs]
    assert set(kinds) == {"direction", "color"}
    for first, second in pairs:
        kind = first.tags["kind"]
        changed = [n for n in ATTRIBUTES if first.attributes[n] != second.attributes[n]]
        assert changed == [kind]
        if kind == "direction":
            assert second.attributes["direction"] == world.OPPOSITE_DIRECTION[first.attributes["direction"]]
        assert first.seed == second.seed
        assert len(set(first.prompt.split()) ^ set(second.prompt.split())) == 2
    noise = world.initial_noise([pairs[0][0].seed, pairs[0][1].seed])
    assert torch.equal(noise[0], noise[1])
