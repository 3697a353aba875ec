"""HSTU over an unpooled collection: causal, jagged end to end, both attention paths, learns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from recsys.models.hstu import CANDIDATES, HISTORY, HSTU
from tests.models.sequence_training import train_and_rank


def _model(
    num_items=40, dim=16, max_len=40, backend="torch", seed=0, dropout=0.1, relative_bias=False
) -> HSTU:
    torch.manual_seed(seed)
    features = [HISTORY, CANDIDATES]
    table = EmbeddingConfig(
        name="item", num_embeddings=num_items, embedding_dim=dim, feature_names=features
    )
    return HSTU(
        EmbeddingCollection(tables=[table]),
        max_len=max_len,
        num_heads=2,
        dropout=dropout,
        relative_bias=relative_bias,
        backend=backend,
    )


def _kjt(histories):
    lengths = [len(h) for h in histories]
    kjt = KeyedJaggedTensor(
        keys=["items"],
        values=torch.tensor([i for h in histories for i in h], dtype=torch.int64),
        lengths=torch.tensor(lengths),
        stride=len(histories),
    )
    return kjt, max(lengths)


@pytest.mark.parametrize("relative_bias", [False, True])
def test_causal_and_independent_of_the_batch(relative_bias):
    model = _model(relative_bias=relative_bias).eval()
    with torch.no_grad():
        alone, _ = model(*_kjt([[5, 6, 7, 8]]))
        changed, _ = model(*_kjt([[5, 6, 7, 30]]))
        batched, _ = model(*_kjt([[1, 2], [5, 6, 7, 8], [], [3, 4, 5, 6, 7, 8, 9]]))
    assert torch.allclose(alone[:3], changed[:3], atol=1e-6)
    assert not torch.allclose(alone[3], changed[3])
    assert torch.allclose(batched[2:6], alone, atol=1e-6)


@pytest.mark.parametrize("relative_bias", [False, True])
def test_the_triton_kernels_give_the_torch_paths_model(relative_bias):
    histories = [[1, 2, 3], [4], list(range(5, 40)), [7, 8]]  # one history past a tile
    kjt, longest = _kjt(histories)
    outs, grads = [], []
    for backend in ("torch", "triton"):
        model = _model(backend=backend, relative_bias=relative_bias).eval()
        if relative_bias:  # a bias large enough to matter, different per position difference
            with torch.no_grad():
                for block in model.blocks:
                    block.position_bias.normal_(std=1.0)
        hidden, _ = model(kjt, longest)
        hidden.square().sum().backward()
        outs.append(hidden.detach())
        block = model.blocks[0]
        grads.append([block.uvqk.weight.grad])
        if relative_bias:
            grads[-1].append(block.position_bias.grad)
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    # fp32 sums in another order, amplified ~1000x by the LayerNorm of the small attention
    # outputs (weights / N): the gradients agree to ~2e-3 of their largest value; a wrong mask
    # or term would differ by its whole size.
    for want, got in zip(grads[0], grads[1], strict=True):
        assert want.abs().max() > 0
        assert (want - got).abs().max() <= 1e-2 * want.abs().max()


def test_the_relative_bias_changes_the_output_and_has_a_table_per_block():
    model = _model(relative_bias=True, max_len=10).eval()
    assert [tuple(b.position_bias.shape) for b in model.blocks] == [(19,), (19,)]
    kjt, longest = _kjt([[1, 2, 3, 4], [5, 6]])
    with torch.no_grad():
        before, _ = model(kjt, longest)
        model.blocks[0].position_bias[9 - 2] += 3.0  # keys two positions back
        after, _ = model(kjt, longest)
    changed = (before - after).abs().amax(dim=1) > 1e-4
    # rows 0, 1 of each history have no key two back; the others do
    assert changed.tolist() == [False, False, True, True, False, False]


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="num_heads=0"):
        _model().__class__(_model().embeddings, max_len=5, num_heads=0)
    with pytest.raises(ValueError, match="a history of 6 items; this HSTU has positions for 5"):
        _model(max_len=5)(*_kjt([[1, 2, 3, 4, 5, 6]]))


@pytest.mark.slow  # ~20-60 s on 2 cores; test_sasrec's twin keeps the pipeline in the default run
def test_it_learns_the_synthetic_process(tmp_path: Path):
    hr, popular, oracle = train_and_rank(
        lambda num_items: _model(num_items=num_items, max_len=20, dropout=0.2), tmp_path
    )
    assert hr > popular + 0.1
    assert hr > 0.6 * oracle
