"""The peer side of ``benchmarks.sasrec_movielens``: RecBole's SASRec (RUCAIBox/RecBole, MIT),
run as a script by the Python of the separate environment RecBole is installed in
(``requirements/peer-sasrec.txt``), never imported by recsys' own environment (it imports
neither recsys nor RecBole at module level, so ``import benchmarks._sasrec_recbole`` works
anywhere).

``fit_log``: RecBole as its users run it: ``<data-dir>/<name>/<name>.inter`` (the atomic file
as the wheel ships it) read by RecBole itself, its leave-one-out split by time (``LS``, ``TO``)
and its augmentation (an example per train target), ``SASRec`` trained by its ``Trainer`` with
valid NDCG@10 every epoch and early stopping (``--stopping-step``), stopped between epochs once
``--budget-s`` seconds have passed since the process started; the best valid model is
tested, and JSON written to ``--out``:

- ``unmasked_hr@10`` / ``unmasked_ndcg@10`` / ``unmasked_mrr``: by the definition of
  ``recsys.train.ranking_metrics`` on RecBole's scores (candidates: every item token but the
  padding; ties count against the target; the history not excluded, as RecBole's evaluator
  does for sequential models); ``masked_*``: the same with every other item of the user masked
  (all of them came before its test target);
- ``recbole_hit@10`` / ``recbole_ndcg@10``: what RecBole's own full-sort evaluator reports on the
  same model;
- epochs, the best epoch, why it stopped, ``train_s``, ``eval_s``, ``wall_s`` (seconds,
  ``wall_s`` from the process start).

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
    parser.add_argument("mode", choices=["fit_log", "step"])
    parser.add_argument("--data-dir", type=Path, help="fit_log: the folder of <name>/<name>.inter")
    parser.add_argument("--name", default="ml-100k", help="fit_log: the atomic file's name")
    parser.add_argument("--num-items", type=int, default=0, help="recsys' item table rows")
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
    parser.add_argument("--budget-s", type=float, default=0, help="fit_log: wall budget (0: none)")
    parser.add_argument("--stopping-step", type=int, default=10, help="fit_log: early stopping")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--warmup", type=int, default=2, help="step: untimed steps")
    parser.add_argument("--repeats", type=int, default=10, help="step: timed steps")
    parser.add_argument("--out", type=Path, required=True, help="the JSON result")
    return parser.parse_args(argv)


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


class _BudgetSpent(Exception):
    """Raised by :func:`_budgeted_trainer`'s trainer when the wall budget ends between epochs."""


def _budgeted_trainer(config, model, budget_s: float, started: float):
    """RecBole's ``Trainer`` that stops between two epochs once ``budget_s`` seconds have passed
    since ``started`` (the best-valid model stays saved where RecBole saved it)."""
    from recbole.trainer import Trainer

    class BudgetedTrainer(Trainer):
        epochs_done = 0

        def _train_epoch(self, train_data, epoch_idx, loss_func=None, show_progress=False):
            if budget_s and time.perf_counter() - started > budget_s:
                raise _BudgetSpent
            loss = super()._train_epoch(train_data, epoch_idx, loss_func, show_progress)
            self.epochs_done = epoch_idx + 1
            return loss

    return BudgetedTrainer(config, model)


def log_config(args: argparse.Namespace, checkpoint_dir: Path):
    """RecBole's own protocol on its own atomic file: ``<data_dir>/<name>/<name>.inter`` as the
    recbole wheel ships it, leave-one-out by time (``LS``, ``TO``: RecBole's stable sort keeps
    ties in file order), full ranking, the best valid NDCG@10 model, early stopping after
    ``stopping_step`` epochs without a better one (RecBole's default 10)."""
    from recbole.config import Config

    values = {
        "data_path": str(args.data_dir or checkpoint_dir),  # step: no data read
        "load_col": {"inter": ["user_id", "item_id", "timestamp"]},
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
        "stopping_step": args.stopping_step,
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


def user_histories(dataset) -> dict[int, list[int]]:
    """Each user's items (RecBole's internal ids) in time order, ties in file order (RecBole's
    own split orders a few ties otherwise: only the set of a user's items is used)."""
    import numpy as np

    users = np.asarray(dataset.inter_feat[dataset.uid_field])
    items = np.asarray(dataset.inter_feat[dataset.iid_field])
    times = np.asarray(dataset.inter_feat[dataset.time_field])
    order = np.lexsort((np.arange(len(users)), times, users))
    histories: dict[int, list[int]] = {}
    for user, item in zip(users[order].tolist(), items[order].tolist(), strict=True):
        histories.setdefault(user, []).append(item)
    return histories


def mask_history(scores, histories: list[list[int]], targets: list[int]):
    """``scores`` [B, N] with every item of row b's ``histories[b]`` (a user's items, its test
    target among them: RecBole's test target is the user's last event, so every other one came
    before it) at -inf but the target: recsys' ``exclude_history``."""
    masked = scores.clone()
    for row, (history, target) in enumerate(zip(histories, targets, strict=True)):
        masked[row, [i for i in history if i != target]] = float("-inf")
    return masked


def fit_log(args: argparse.Namespace) -> dict:
    import torch
    from recbole.data import create_dataset, data_preparation
    from recbole.model.sequential_recommender import SASRec
    from recbole.utils import init_seed

    started = time.perf_counter()
    config = log_config(args, Path.cwd() / "checkpoints")
    init_seed(config["seed"], config["reproducibility"])
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = create_dataset(config)
    histories = user_histories(dataset)
    train_data, valid_data, test_data = data_preparation(config, dataset)
    init_seed(config["seed"], config["reproducibility"])
    model = SASRec(config, train_data.dataset).to(config["device"])
    trainer = _budgeted_trainer(config, model, args.budget_s, started)
    stopped_by = "early_stopping"
    try:
        trainer.fit(train_data, valid_data, saved=True, show_progress=False)
        if trainer.epochs_done == args.epochs:
            stopped_by = "epochs"
    except _BudgetSpent:
        stopped_by = "budget"
    train_s = time.perf_counter() - started
    best = torch.load(trainer.saved_model_file, map_location=config["device"], weights_only=False)
    model.load_state_dict(best["state_dict"])
    evaluated = time.perf_counter()
    own = trainer.evaluate(test_data, load_best_model=False, show_progress=False)
    candidates = torch.arange(1, dataset.item_num)  # every item token but [PAD]
    ranks: dict[str, list[int]] = {"unmasked": [], "masked": []}
    model.eval()
    with torch.no_grad():
        for interaction, _, _, targets in test_data:
            scores = model.full_sort_predict(interaction.to(config["device"])).cpu()
            scores = scores.view(len(targets), -1).double()
            ranks["unmasked"] += target_ranks(scores, targets, candidates).tolist()
            users = interaction[dataset.uid_field].cpu().tolist()
            seen = [histories[user] for user in users]
            masked = mask_history(scores, seen, targets.tolist())
            ranks["masked"] += target_ranks(masked, targets, candidates).tolist()
    result = {}
    for kind, values in ranks.items():
        for name, value in metrics_from_ranks(values).items():
            result[f"{kind}_{name}"] = value
    result.update(
        {
            "recbole_hit@10": float(own["hit@10"]),
            "recbole_ndcg@10": float(own["ndcg@10"]),
            "best_valid_ndcg@10": float(trainer.best_valid_score),
            "best_epoch": int(best["epoch"]) + 1,
            "epochs": trainer.epochs_done,
            "stopped_by": stopped_by,
            "test_users": len(ranks["masked"]),
            "items": dataset.item_num - 1,
            "train_examples": len(train_data.dataset),
            "train_s": train_s,
            "eval_s": time.perf_counter() - evaluated,
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

    config = log_config(args, Path.cwd() / "checkpoints")
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
    if args.mode == "fit_log" and args.data_dir is None:
        raise SystemExit("fit_log needs --data-dir (the directory of <name>/<name>.inter)")
    result = fit_log(args) if args.mode == "fit_log" else step(args)
    import recbole
    import torch

    result["versions"] = f"recbole={recbole.__version__} torch={torch.__version__}"
    result["wall_s"] = time.perf_counter() - START
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
