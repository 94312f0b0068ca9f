"""Our DiT forward equals diffusers' QwenImage21Transformer2DModel with the same weights (fp32, <= 2e-5).

Cases cover every way the block-causal layout can go wrong: no reference, one to three references (two of
them adjacent, which must stay separate blocks), a right-padded batch (padded keys never read, positions
still advanced), non-square targets, references of different sizes, odd latent grids, and per-sample
timesteps.
"""

import pytest
import torch

from dit_fixtures import Case, make_case, reference_velocity, tiny_pair

TOL = 2e-5

CASES = [
    pytest.param(Case(refs=(), target=(4, 6), runs=(9,)), id="t2i"),
    pytest.param(Case(refs=((4, 4),), target=(4, 6), runs=(5, 7)), id="one_reference"),
    pytest.param(Case(refs=((4, 4), (2, 6)), target=(6, 4), runs=(5, 3, 6)), id="two_references"),
    pytest.param(Case(refs=((4, 4), (2, 6), (6, 2)), target=(4, 4), runs=(4, 0, 2, 5)),
                 id="three_references_two_adjacent"),
    pytest.param(Case(refs=((4, 4),), target=(4, 6), runs=(5, 9), batch=2, pad=(0, 4)), id="batch2_right_padded"),
    pytest.param(Case(refs=(), target=(6, 4), runs=(11,), batch=2, pad=(3, 0)), id="batch2_padded_t2i"),
    pytest.param(Case(refs=((6, 10), (2, 2)), target=(3, 4), runs=(3, 2, 4)), id="non_square_and_odd_grid"),
]


@pytest.mark.parametrize("case", CASES)
def test_forward_matches_diffusers(dit_pair, case):
    reference, ours = dit_pair
    kwargs, prefixes, target_latents = case.make()
    t = torch.linspace(0.9, 0.4, case.batch)
    with torch.no_grad():
        expected = reference_velocity(reference, kwargs, t)
        got = ours(target_latents, t, prefixes)
    torch.testing.assert_close(got, expected, rtol=0, atol=TOL)


def test_shared_prompt_batch_matches_diffusers_per_sample(dit_pair):
    """A batch whose samples share one prompt runs that prefix once and still equals the reference."""
    reference, ours = dit_pair
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
