"""The peer side of ``benchmarks.sasrec_movielens``: RecBole's SASRec (RUCAIBox/RecBole, MIT),
run as a script by the Python of the separate environment RecBole is installed in
(``requirements/peer-sasrec.txt``), never imported by recsys' own environment (it imports
neither recsys nor RecBole at module level, so ``import benchmarks._sasrec_recbole`` works
anywhere).

``fit``: trains ``recbole.model.sequential_recommender.SASRec`` with RecBole's ``Trainer`` on the
atomic files that :func:`benchmarks._movielens.export_recbole` wrote from a recsys split
(``<name>.train.inter`` / ``.valid.inter`` / ``.test.inter`` pre-split, ``benchmark_filename``
mode, so RecBole neither re-splits nor re-augments), for a fixed number of epochs with no early
stopping and no checkpoint, then ranks every item for each test user and writes JSON to
``--out``:

- ``hr@10`` / ``ndcg@10`` / ``mrr``: by the definition of ``recsys.train.ranking_metrics`` on
  RecBole's scores (candidates: the recsys ids ``first_item`` .. ``num_items - 1``; ties count
  against the target; the history is not excluded; a target that is not a candidate, an item
  unseen in training, is a miss);
- ``recbole_hit@10`` / ``recbole_ndcg@10``: what RecBole's own full-sort evaluator reports on the
  same model (its candidates: every token it loaded except padding, so an unseen target can be
  hit; no history exclusion for sequential models either);
- ``train_s``, ``eval_s``, ``wall_s`` (seconds, ``wall_s`` from the process start).

``step``: times one training step of the same model (``calculate_loss``, backward, Adam) on a
fixed batch of ``--batch-size`` random histories of ``--max-len`` items; writes p20 / p50 / p80 ms.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

START = time.perf_counter()
NAME_FIELDS = {"user": "user_id", "item": "item_id", "items": "item_id_list"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["fit", "step"])
    parser.add_argument("--data-dir", type=Path, help="fit: the directory of the atomic files")
    parser.add_argument("--name", default="recsys_split", help="fit: the atomic files' prefix")
    parser.add_argument("--num-items", type=int, required=True, help="recsys' item table rows")
    parser.add_argument("--first-item", type=int, default=3, help="first candidate recsys id")
    parser.add_argument("--max-len", type=int, default=50)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ffn-dim", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--warmup", type=int, default=2, help="step: untimed steps")
    parser.add_argument("--repeats", type=int, default=10, help="step: timed steps")
    parser.add_argument("--out", type=Path, required=True, help="the JSON result")
    return parser.parse_args(argv)


def recbole_config(args: argparse.Namespace, checkpoint_dir: Path):
    from recbole.config import Config

    values = {
        "data_path": str(args.data_dir or checkpoint_dir),
        "benchmark_filename": ["train", "valid", "test"],
        "alias_of_item_id": [NAME_FIELDS["items"]],
        "load_col": {
            "inter": [NAME_FIELDS["user"], NAME_FIELDS["items"], NAME_FIELDS["item"]],
            "item": [NAME_FIELDS["item"]],
        },
        "USER_ID_FIELD": NAME_FIELDS["user"],
        "ITEM_ID_FIELD": NAME_FIELDS["item"],
        "MAX_ITEM_LIST_LENGTH": args.max_len,
        "hidden_size": args.dim,
        "inner_size": args.ffn_dim,
        "n_layers": args.blocks,
        "n_heads": args.heads,
        "hidden_dropout_prob": args.dropout,
        "attn_dropout_prob": args.dropout,
        "loss_type": "CE",
        "train_neg_sample_args": None,
        "epochs": args.epochs,
        "learning_rate": args.lr,
        "train_batch_size": args.batch_size,
        "eval_batch_size": 512,
        "eval_args": {"split": {"LS": "valid_and_test"}, "order": "TO", "mode": "full"},
        "metrics": ["Hit", "NDCG", "MRR"],
        "topk": [10],
        "valid_metric": "NDCG@10",
        "seed": args.seed,
        "reproducibility": True,
        "use_gpu": args.device == "cuda",
        "show_progress": False,
        "checkpoint_dir": str(checkpoint_dir),
        "save_dataset": False,
        "save_dataloaders": False,
        "log_wandb": False,
    }
    return Config(model="SASRec", dataset=args.name, config_dict=values)


def target_ranks(scores, targets, candidates):
    """Rank of each target among ``candidates`` (columns of ``scores``) by the definition of
    ``recsys.train.ranking_metrics.target_ranks``; -1 where the target is not a candidate.

    scores: [B, N] float; targets: [B] column ids; candidates: [C] column ids.
    """
    import torch

    scores = scores.double()
    rows = torch.arange(len(targets))
    target_scores = scores[rows, targets]  # [B]
    is_candidate = torch.zeros(scores.shape[1], dtype=torch.bool)
    is_candidate[candidates] = True
    others = scores[:, candidates]  # [B, C]
    ahead = (others >= target_scores[:, None]).sum(dim=1)
    ahead -= is_candidate[targets].long()  # the target is not counted against itself
    return torch.where(is_candidate[targets], ahead, -1)


def metrics_from_ranks(ranks, k: int = 10) -> dict[str, float]:
    top = [r for r in ranks if 0 <= r < k]
    return {
        f"hr@{k}": len(top) / len(ranks),
        f"ndcg@{k}": sum(1 / math.log2(r + 2) for r in top) / len(ranks),
        "mrr": sum(1 / (r + 1) for r in ranks if r >= 0) / len(ranks),
    }


def fit(args: argparse.Namespace) -> dict:
    import torch
    from recbole.data import create_dataset, data_preparation
    from recbole.model.sequential_recommender import SASRec
    from recbole.trainer import Trainer
    from recbole.utils import init_seed

    config = recbole_config(args, Path.cwd() / "checkpoints")
    init_seed(config["seed"], config["reproducibility"])
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = create_dataset(config)
    train_data, _, test_data = data_preparation(config, dataset)
    init_seed(config["seed"], config["reproducibility"])
    model = SASRec(config, train_data.dataset)
    trainer = Trainer(config, model)
    started = time.perf_counter()
    trainer.fit(train_data, valid_data=None, saved=False, show_progress=False)
    train_s = time.perf_counter() - started

    started = time.perf_counter()
    own = trainer.evaluate(test_data, load_best_model=False, show_progress=False)
    tokens = dataset.field2id_token[NAME_FIELDS["item"]]  # internal id -> token
    internal = torch.full((args.num_items,), -1, dtype=torch.int64)
    for index, token in enumerate(tokens[1:], start=1):  # 0: RecBole's [PAD]
        if 0 <= int(token) < args.num_items:
            internal[int(token)] = index
    candidates = internal[args.first_item :]
    if (candidates < 0).any():
        raise ValueError("an item id of recsys' corpus is missing from the exported .item file")
    candidate_ids = torch.zeros(len(tokens), dtype=torch.bool)
    candidate_ids[candidates] = True
    ranks: list[int] = []
    model.eval()
    with torch.no_grad():
        for interaction, _, _, targets in test_data:
            scores = model.full_sort_predict(interaction.to(config["device"])).cpu()
            ranks += target_ranks(scores.view(len(targets), -1), targets, candidates).tolist()
    eval_s = time.perf_counter() - started
    result = metrics_from_ranks(ranks)
    result.update(
        {
            "recbole_hit@10": float(own["hit@10"]),
            "recbole_ndcg@10": float(own["ndcg@10"]),
            "test_users": len(ranks),
            "train_examples": len(train_data.dataset),
            "steps": math.ceil(len(train_data.dataset) / args.batch_size) * args.epochs,
            "train_s": train_s,
            "eval_s": eval_s,
        }
    )
    return result


class _Corpus:
    """What SASRec reads of a dataset to build itself: the number of item ids."""

    def __init__(self, num_items: int) -> None:
        self.num_items = num_items

    def num(self, field: str) -> int:
        return self.num_items


def step(args: argparse.Namespace) -> dict:
    import torch
    from recbole.data.interaction import Interaction
    from recbole.model.sequential_recommender import SASRec
    from recbole.utils import init_seed

    config = recbole_config(args, Path.cwd() / "checkpoints")
    init_seed(config["seed"], config["reproducibility"])
    if args.threads:
        torch.set_num_threads(args.threads)
    items = args.num_items - args.first_item + 1  # the candidates and RecBole's padding 0
    device = config["device"]
    model = SASRec(config, _Corpus(items)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.batch_size, args.max_len)
    batch = Interaction(
        {
            NAME_FIELDS["items"]: torch.randint(1, items, shape, generator=generator),
            "item_length": torch.full((args.batch_size,), args.max_len),
            NAME_FIELDS["item"]: torch.randint(1, items, (args.batch_size,), generator=generator),
        }
    ).to(device)
    model.train()

    def one_step() -> None:
        optimizer.zero_grad()
        model.calculate_loss(batch).backward()
        optimizer.step()

    for _ in range(args.warmup):
        one_step()
    times = []
    for _ in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        one_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return {"times_ms": times}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.mode == "fit" and args.data_dir is None:
        raise SystemExit("fit needs --data-dir (the directory of the exported atomic files)")
    result = fit(args) if args.mode == "fit" else step(args)
    import recbole
    import torch

    result["versions"] = f"recbole={recbole.__version__} torch={torch.__version__}"
    result["wall_s"] = time.perf_counter() - START
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
