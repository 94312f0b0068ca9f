"""The DiT's gradients, which only the toy's training (demo/train_toy.py) uses: autograd takes its own path through
the blocks (one split per buffer, the target attention on concatenated keys), and that path must give the true
derivative of the same forward. Checked against central differences along a random direction (float64 weights;
the q/k norm computes in fp32 whatever the weights are)."""

import copy

import pytest
import torch

from dit_fixtures import make_case, tiny_pair
from qi21.model.transformer.attention import target_attention
from qi21.model.transformer.training import with_training_paths


def _dense_target_attention(q, k, v, prefix_k, prefix_v):
    keys = torch.cat([prefix_k.expand(q.shape[0], -1, -1, -1), k], dim=1)
    values = torch.cat([prefix_v.expand(q.shape[0], -1, -1, -1), v], dim=1)
    scores = torch.einsum("sqhd,skhd->shqk", q, keys) / q.shape[-1] ** 0.5
    return torch.einsum("shqk,skhd->sqhd", scores.softmax(-1), values)


def test_target_attention_gradients_follow_the_softmax_across_prefix_and_target():
    # the CPU kernel merges two partial softmaxes through a log-sum-exp that carries no gradient: under autograd the
    # weight moving between the prefix's keys and the target's must still be differentiated
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, 6, 2, 8)] * 3 + [(5, 2, 8)] * 2
    inputs = [torch.randn(s, generator=generator, dtype=torch.float64, requires_grad=True) for s in shapes]
    weight = torch.randn(2, 6, 2, 8, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad((target_attention(*inputs) * weight).sum(), inputs)
    want = torch.autograd.grad((_dense_target_attention(*inputs) * weight).sum(), inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def _batch(sample_prefix):
    _, plain, target_a = make_case([], (4, 4), [5], seed=1)
    _, edit, target_b = make_case([(4, 4)], (4, 4), [3, 2], seed=2)
    targets = {0: target_a[0], 1: target_b[0]}
    return [plain[0], edit[0]], torch.stack([targets[g] for g in sample_prefix]).double()


@pytest.mark.parametrize("sample_prefix", [[0, 0, 1], [0, 1, 0]], ids=["consecutive", "interleaved"])
def test_dit_gradients_are_the_derivative_of_its_forward(sample_prefix):
    _, plain = tiny_pair(seed=3)
    plain = plain.double()
    model = with_training_paths(copy.deepcopy(plain).requires_grad_(True))
    prefixes, target = _batch(sample_prefix)
    prefixes = [type(p)(layout=p.layout, text=p.text.double(),
                        references=None if p.references is None else p.references.double()) for p in prefixes]
    timestep = torch.tensor([0.9, 0.4, 0.7], dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(target.shape, generator=generator, dtype=torch.float64)
    direction = [torch.randn(p.shape, generator=generator, dtype=torch.float64) for p in params]

    def loss():
        return (model(target, timestep, prefixes, sample_prefix=sample_prefix) * weight).sum()

    with torch.no_grad():
        inference = plain(target, timestep, prefixes, sample_prefix=sample_prefix)
    recorded = model(target, timestep, prefixes, sample_prefix=sample_prefix)
    torch.testing.assert_close(recorded, inference, rtol=1e-5, atol=1e-5)  # the same forward (q, k normed in fp32)
    grads = torch.autograd.grad((recorded * weight).sum(), params)
    analytic = sum((g * d).sum() for g, d in zip(grads, direction))

    eps = 1e-3
    with torch.no_grad():
        for p, d in zip(params, direction):
            p.add_(d, alpha=eps)
        plus = loss()
        for p, d in zip(params, direction):
            p.add_(d, alpha=-2 * eps)
        minus = loss()
    # q and k are normed in fp32 even here, so the agreement is ~1e-4; the log-sum-exp merge's constant weights
    # were 2% off along this direction
    torch.testing.assert_close(analytic, (plus - minus) / (2 * eps), rtol=1e-3, atol=1e-6)


def test_a_long_lived_layout_keeps_only_its_latest_batch_compositions():
    # a training set (or a prompt ComfyUI keeps for days) meets ever new batches: their row tables must not pile
    # up on its layout, while a sampling loop's repeated batch finds its table again
    from qi21.model.transformer.dit import ROWS_ROPE_KEPT

    _, model = tiny_pair(seed=5)
    first, _ = _batch([0])
    others = [make_case([], (4, 4), [2 + n], seed=10 + n)[1][0] for n in range(2 * ROWS_ROPE_KEPT)]
    target = torch.zeros(2, first[0].layout.target_len, 64)
    with torch.no_grad():
        model(target, 0.5, [first[0], others[0]], sample_prefix=[0, 1])
        table = first[0].layout.derived["rows_rope"]
        (kept,) = table.values()
        model(target, 0.5, [first[0], others[0]], sample_prefix=[0, 1])
        assert next(iter(table.values())) is kept  # the same batch again: the same table
        for other in others[1:]:
            model(target, 0.5, [first[0], other], sample_prefix=[0, 1])
    assert len(table) == ROWS_ROPE_KEPT
