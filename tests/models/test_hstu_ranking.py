"""Target-aware HSTU ranking: candidates as attention targets, scored by a head; each score is
independent of the other candidates and of the batch, both attention paths agree, and it
learns the synthetic click process well above chance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from recsys.data.synthetic_ranking import oracle_auc, synthetic_ranking
from recsys.data.synthetic_sequences import SyntheticSequences
from recsys.models.hstu_ranking import HSTURanking
from recsys.models.sequence import CANDIDATES, HISTORY


def _model(num_items=40, dim=16, max_len=40, max_candidates=8, backend="torch", seed=0):
    torch.manual_seed(seed)
    table = EmbeddingConfig(
        name="item",
        num_embeddings=num_items,
        embedding_dim=dim,
        feature_names=[HISTORY, CANDIDATES],
    )
    return HSTURanking(
        EmbeddingCollection(tables=[table]),
        max_len=max_len,
        max_candidates=max_candidates,
        num_heads=2,
        dropout=0.1,
        backend=backend,
    )


def _kjt(lists):
    return KeyedJaggedTensor(
        keys=["ids"],
        values=torch.tensor([i for row in lists for i in row], dtype=torch.int64),
        lengths=torch.tensor([len(row) for row in lists]),
        stride=len(lists),
    )


def _score(model, histories, candidates):
    return model(
        _kjt(histories),
        max(map(len, histories)),
        _kjt(candidates),
        max(map(len, candidates)),
    )[:, 0]


def test_a_score_depends_on_its_history_not_on_other_candidates_or_the_batch():
    model = _model().eval()
    with torch.no_grad():
        alone = _score(model, [[5, 6, 7]], [[9, 10, 11]])
        other = _score(model, [[5, 6, 7]], [[9, 30, 11, 12]])
        batched = _score(model, [[1, 2], [5, 6, 7], []], [[3], [9, 10, 11], [4, 5]])
        moved = _score(model, [[5, 6, 8]], [[9, 10, 11]])
    assert torch.allclose(alone[[0, 2]], other[[0, 2]], atol=1e-6)
    assert torch.allclose(batched[1:4], alone, atol=1e-6)
    assert not torch.allclose(moved, alone, atol=1e-4)


def test_the_triton_kernels_give_the_torch_paths_scores(monkeypatch):
    """Attention, the jagged concat / split of history and candidates and the position add
    all on their Triton kernels (RECSYS_BACKEND=triton: every op's "auto")."""
    histories = [[1, 2, 3], [4], list(range(5, 40)), []]
    candidates = [[1, 5], [7, 8, 9], [3], [2, 4, 6, 8]]
    scores, grads = [], []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("RECSYS_BACKEND", backend)
        model = _model(backend=backend).eval()
        score = _score(model, histories, candidates)
        score.square().sum().backward()
        scores.append(score.detach())
        grads.append([model.blocks[0].position_bias.grad, model.positions.weight.grad])
        grads[-1] += [model.target.grad, model.embeddings.embeddings["item"].weight.grad]
    assert torch.allclose(scores[0], scores[1], atol=1e-5)
    for want, got in zip(grads[0], grads[1], strict=True):
        assert want.abs().max() > 0
        assert (want - got).abs().max() <= 1e-2 * want.abs().max()


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="9 candidates; this HSTURanking reads at most 40 and 8"):
        _score(_model(), [[1]], [list(range(9))])
    with pytest.raises(ValueError, match="2 histories and 1 candidate lists"):
        _model()(_kjt([[1], [2]]), 1, _kjt([[3]]), 1)


def _batches(samples, users, size, max_len):
    for start in range(0, len(users), size):
        picked = users[start : start + size]
        histories = [
            samples.items[samples.offsets[u] : samples.offsets[u + 1]][-max_len:].tolist()
            for u in picked
        ]
        candidates = samples.candidates[picked].tolist()
        yield histories, candidates, torch.from_numpy(samples.labels[picked].ravel())


@pytest.mark.slow  # ~10-40 s on 2 cores
def test_it_learns_the_synthetic_click_process():
    from torchmetrics.functional.classification import binary_auroc

    params = SyntheticSequences(
        num_users=700, num_items=120, num_topics=8, mean_events=12.0, max_events=30, seed=3
    )
    samples = synthetic_ranking(params, num_candidates=6)
    train, test = np.arange(600), np.arange(600, 700)
    model = _model(num_items=120, max_len=30, max_candidates=6)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = np.random.default_rng(0)
    for _ in range(4):
        for histories, candidates, labels in _batches(
            samples, generator.permutation(train), 32, 30
        ):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                _score(model, histories, candidates), labels
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        scores, labels = zip(
            *[(_score(model, h, c), y) for h, c, y in _batches(samples, test, 100, 30)],
            strict=True,
        )
    auc = float(binary_auroc(torch.cat(scores), torch.cat(labels).long()))
    best = oracle_auc(samples, test)
    assert best > 0.7  # the process is learnable
    assert auc > 0.5 + 0.6 * (best - 0.5), (auc, best)
