"""Our DiT forward equals diffusers' QwenImage21Transformer2DModel with the same weights (fp32, <= 2e-5).

Cases cover every way the block-causal layout can go wrong: no reference, one to three references (two of
them adjacent, which must stay separate blocks), a right-padded batch (padded keys never read, positions
still advanced), non-square targets, references of different sizes, odd latent grids, and per-sample
timesteps.
"""

import pytest
import torch

from dit_fixtures import make_case, reference_velocity, tiny_pair

TOL = 2e-5

CASES = {
    # name: (reference latent shapes, target shape, text runs around them, batch, right padding per sample)
    "t2i": ((), (4, 6), (9,), 1, ()),
    "one_reference": (((4, 4),), (4, 6), (5, 7), 1, ()),
    "two_references": (((4, 4), (2, 6)), (6, 4), (5, 3, 6), 1, ()),
    "three_references_two_adjacent": (((4, 4), (2, 6), (6, 2)), (4, 4), (4, 0, 2, 5), 1, ()),
    "batch2_right_padded": (((4, 4),), (4, 6), (5, 9), 2, (0, 4)),
    "batch2_padded_t2i": ((), (6, 4), (11,), 2, (3, 0)),
    "non_square_and_odd_grid": (((6, 10), (2, 2)), (3, 4), (3, 2, 4), 1, ()),
}


@pytest.fixture(scope="module")
def models():
    return tiny_pair()


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_diffusers(models, name):
    reference, ours = models
    refs, target, runs, batch, pad = CASES[name]
    kwargs, prefixes, target_latents = make_case(refs, target, runs, batch=batch, pad=pad)
    t = torch.linspace(0.9, 0.4, batch)
    with torch.no_grad():
        expected = reference_velocity(reference, kwargs, t)
        got = ours(target_latents, t, prefixes)
    torch.testing.assert_close(got, expected, rtol=0, atol=TOL)


def test_shared_prompt_batch_matches_diffusers_per_sample(models):
    """A batch whose samples share one prompt runs that prefix once and still equals the reference."""
    reference, ours = models
    kwargs, prefixes, target_latents = make_case(((4, 4),), (4, 6), (5, 7), batch=3)
    kwargs["encoder_hidden_states"] = kwargs["encoder_hidden_states"][:1].expand(3, -1, -1)
    shared = [type(prefixes[0])(layout=prefixes[0].layout, text=kwargs["encoder_hidden_states"][0],
                                references=prefixes[0].references)]
    t = torch.tensor([0.8, 0.5, 0.2])
    with torch.no_grad():
        expected = reference_velocity(reference, kwargs, t)
        got = ours(target_latents, t, shared)
    torch.testing.assert_close(got, expected, rtol=0, atol=TOL)


def test_without_causal_condition_matches_diffusers():
    reference, ours = tiny_pair(causal_condition=False)
    kwargs, prefixes, target_latents = make_case(((4, 4),), (4, 6), (5, 7), batch=2)
    t = torch.tensor([0.7, 0.3])
    with torch.no_grad():
        torch.testing.assert_close(ours(target_latents, t, prefixes), reference_velocity(reference, kwargs, t),
                                   rtol=0, atol=TOL)
