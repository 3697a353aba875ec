"""HSTU over an unpooled collection: causal, jagged end to end, both attention paths, learns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

import recsys.models.hstu as hstu
from recsys.data.sequence_batches import SequenceBatch
from recsys.models.hstu import CANDIDATES, HISTORY, HSTU, TIME_BUCKETS
from recsys.models.next_item import next_item_loss
from recsys.ops.jagged.attention import jagged_attention_reference
from tests.models.sequence_training import train_and_rank


def _model(
    num_items=40,
    dim=16,
    max_len=40,
    backend="torch",
    seed=0,
    dropout=0.1,
    relative_bias=False,
    time_bias=False,
    time_convention="own",
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
        time_bias=time_bias,
        time_convention=time_convention,
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
def test_the_triton_kernels_give_the_torch_paths_model(relative_bias, monkeypatch):
    histories = [[1, 2, 3], [4], list(range(5, 40)), [7, 8]]  # one history past a tile
    kjt, longest = _kjt(histories)
    outs, grads = [], []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("RECSYS_BACKEND", backend)  # the position add's "auto" too
        model = _model(backend=backend, relative_bias=relative_bias).eval()
        if relative_bias:  # a bias large enough to matter, different per position difference
            with torch.no_grad():
                for block in model.blocks:
                    block.position_bias.normal_(std=1.0)
        hidden, _ = model(kjt, longest)
        hidden.square().sum().backward()
        outs.append(hidden.detach())
        block = model.blocks[0]
        grads.append([block.uvqk.weight.grad, model.positions.weight.grad])
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


def _times(histories, seed=0):
    """Increasing event times per history, seconds apart to days apart (several buckets)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for h in histories:
        gaps = torch.exp(torch.rand(len(h), generator=gen, dtype=torch.float64) * 12)
        out.append(1.6e9 + torch.cumsum(gaps, 0))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


@pytest.mark.parametrize("time_convention", ["own", "next"])
def test_the_time_bias_block_attends_as_the_reference(monkeypatch, time_convention):
    model = _model(relative_bias=True, time_bias=True, time_convention=time_convention).eval()
    block = model.blocks[0]
    assert block.time_bias.shape == (TIME_BUCKETS + 1,) and model.uses_times
    with torch.no_grad():
        block.time_bias.normal_(std=1.0)  # a bias that matters
    histories = [[1, 2, 3], [], list(range(5, 25)), [7]]
    kjt, longest = _kjt(histories)
    times = _times(histories)
    captured = {}
    original = hstu.jagged_attention

    def spy(q, k, v, offsets, max_len, **options):
        out = original(q, k, v, offsets, max_len, **options)
        captured.update(q=q, k=k, v=v, offsets=offsets, options=options, out=out)
        return out

    monkeypatch.setattr(hstu, "jagged_attention", spy)
    with torch.no_grad():
        model(kjt, longest, times=times)
    options = dict(captured["options"])
    assert options["timestamps"] is times and options["time_weights"] is not None
    assert options["time_convention"] == time_convention
    for name in ("backend", "validate"):
        options.pop(name)
    want = jagged_attention_reference(
        captured["q"], captured["k"], captured["v"], captured["offsets"], 40, **options
    )
    torch.testing.assert_close(captured["out"].double(), want, atol=1e-6, rtol=1e-5)


def test_the_time_bias_reads_the_times_and_needs_them():
    model = _model(relative_bias=True, time_bias=True).eval()
    histories = [[1, 2, 3, 4], [5, 6]]
    kjt, longest = _kjt(histories)
    times = _times(histories)
    with torch.no_grad():
        for block in model.blocks:
            block.time_bias.normal_(std=1.0)
        before, _ = model(kjt, longest, times=times)
        spread = times.clone()
        spread[:4] = 1.6e9 + torch.tensor([0.0, 1e5, 2e5, 3e5], dtype=torch.float64)
        after, _ = model(kjt, longest, times=spread)
        assert torch.equal(before[4:], after[4:])  # the other history's times did not change
        assert not torch.allclose(before[1:4], after[1:4])  # its attention did
        users = model.user_vectors(kjt, longest, times)
        assert torch.equal(users[1], before[5])
        model.item_vectors()  # the corpus needs no times
    with pytest.raises(ValueError, match="learns a time bias: it needs the events' times"):
        model(kjt, longest)
    with pytest.raises(ValueError, match="needs the events' times \\[6\\]"):
        model(kjt, longest, times=times[:5])


@pytest.mark.parametrize("time_convention", ["own", "next"])
def test_the_time_bias_kernels_give_the_torch_paths_model(time_convention):
    histories = [[1, 2, 3], [4], list(range(5, 40)), [7, 8]]
    kjt, longest = _kjt(histories)
    times = _times(histories, seed=1)
    outs, grads = [], []
    for backend in ("torch", "triton"):
        model = _model(
            backend=backend, relative_bias=True, time_bias=True, time_convention=time_convention
        ).eval()
        with torch.no_grad():
            for block in model.blocks:
                block.time_bias.normal_(std=1.0, generator=torch.Generator().manual_seed(3))
        hidden, _ = model(kjt, longest, times=times)
        hidden.square().sum().backward()
        outs.append(hidden.detach())
        grads.append(model.blocks[0].time_bias.grad)
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    assert grads[0].abs().max() > 0
    assert (grads[0] - grads[1]).abs().max() <= 1e-2 * grads[0].abs().max()


def test_the_time_convention_changes_the_attention_and_needs_the_time_bias():
    histories = [[1, 2, 3, 4], [5, 6, 7]]
    kjt, longest = _kjt(histories)
    times = _times(histories)
    outs = []
    for time_convention in ("own", "next"):
        model = _model(relative_bias=True, time_bias=True, time_convention=time_convention)
        with torch.no_grad():
            for block in model.blocks:
                block.time_bias.normal_(std=1.0, generator=torch.Generator().manual_seed(2))
            outs.append(model.eval()(kjt, longest, times=times)[0])
    assert not torch.allclose(outs[0], outs[1])
    with pytest.raises(ValueError, match="time_convention='next' with time_bias=False"):
        _model(relative_bias=True, time_convention="next")
    with pytest.raises(ValueError, match="time_convention='later' with time_bias=True"):
        _model(relative_bias=True, time_bias=True, time_convention="later")


def test_with_the_time_bias_the_next_item_loss_falls():
    model = _model(relative_bias=True, time_bias=True, max_len=20, dropout=0.0)
    gen = torch.Generator().manual_seed(0)
    # histories cycling through 4 items: the next item is predictable
    histories = [[3 + (s + i) % 4 for i in range(8)] for s in range(8)]
    inputs = [h[:-1] for h in histories]
    kjt, longest = _kjt(inputs)
    batch = SequenceBatch(
        kjt,
        _times(inputs),
        torch.tensor([i for h in histories for i in h[1:]]),
        longest,
        next_item=True,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(12):
        loss = next_item_loss(model, batch, in_batch=8, uniform=8, first_item=3, generator=gen)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert model.blocks[0].time_bias.grad.abs().max() > 0
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses
