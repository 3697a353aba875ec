"""A small synthetic next-item task that sequence model tests train on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import torch

from recsys.config import PreprocessConfig
from recsys.data.sequence_batches import SequenceLoader
from recsys.data.sequences import preprocess_interactions
from recsys.data.synthetic_sequences import SyntheticSequences, generate_log, oracle_metrics
from recsys.models.next_item import next_item_loss
from recsys.models.sequence import SequenceEncoder
from recsys.train.ranking_metrics import RankingMetrics


def train_and_rank(
    make_model: Callable[[int], SequenceEncoder], tmp_path: Path, epochs: int = 6
) -> tuple[float, float, float]:
    """Train ``make_model(num_items)`` (max_len 20) on a 600-user synthetic log; its test
    HR@10, that of ranking by popularity, and the oracle's expected HR@10."""
    params = SyntheticSequences(
        num_users=600, num_items=120, num_topics=6, mean_events=15, max_events=30, seed=2
    )
    log, truth = generate_log(params)
    pq.write_table(log, tmp_path / "log.parquet")
    config = PreprocessConfig(
        format="interactions",
        input=str(tmp_path / "log.parquet"),
        output=str(tmp_path / "data"),
        user="user",
        item="item",
        time="time",
        max_len=20,
    )
    preprocess_interactions(config)
    train = SequenceLoader(tmp_path / "data", "train", 64, seed=0)
    test = SequenceLoader(tmp_path / "data", "test", 256)
    model = make_model(train.num_items)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    generator = torch.Generator().manual_seed(0)
    for epoch in range(epochs):
        for batch in train.epoch(epoch):
            loss = next_item_loss(model, batch, first_item=3, generator=generator)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    metrics, popular = RankingMetrics(first_item=3), RankingMetrics(first_item=3)
    counts = torch.bincount(torch.from_numpy(train.histories.values), minlength=train.num_items)
    with torch.no_grad():
        items = model.item_vectors()
        for batch in test.epoch():
            metrics.update(model.user_vectors(batch.items, batch.max_length), items, batch.targets)
            by_count = counts.float()[None, :].expand(batch.size, -1)  # one score per item
            popular.update(by_count.contiguous(), torch.eye(train.num_items), batch.targets)
    oracle = oracle_metrics(params, truth)["hr@10"]
    return metrics.compute()["hr@10"], popular.compute()["hr@10"], oracle
