"""SASRec on a real log, on the peer's protocol: recsys against RecBole's SASRec, each run as
its users run it on MovieLens 100K, same metrics; and the training step of both at max_len 50
and 200.

Data (``benchmarks/_movielens.py``): ``ml-100k.inter`` as the ``recbole==1.2.1`` wheel ships it,
read from the installed package or the wheel (``--wheel``); nothing is downloaded.

The protocol (RecBole's, and the sequential-recommendation literature's): leave-one-out by
time (per user, test predicts the last event, valid the one before, train holds the rest; ties
in timestamp kept in file order), full ranking over every item of the log, the model with the
best valid NDCG@10 tested, early stopping after ``--patience`` evaluations without a better
one (RecBole's ``stopping_step``, 10), at most ``--epochs`` epochs and, for the peer, a wall
budget (``--budget-s``).

- **RecBole** (``_sasrec_recbole.py fit_log``, in its own environment: ``--peer-python``): reads
  ``ml-100k.inter`` itself (its own split, its own augmentation: a training example per
  target with the up to max_len items before it, 97,171 per epoch), trains with its
  ``Trainer`` (valid every epoch), and the best valid model is tested.
- **recsys**: ``recsys preprocess --format interactions --preprocess.item_universe=log`` of the
  same log as a CSV (every item of the log a candidate, as RecBole ranks; whole histories), then
  ``python -m recsys train`` (a subprocess: the command line users run) with
  ``train.next_item.train_rows`` (default ``windows``: every train event a target once per
  epoch, in windows of max_len + 1), valid every epoch, ``checkpoint.keep_best =
  valid_ndcg@10`` and early stopping, then ``recsys eval`` of the best checkpoint
  (:func:`recsys.train.evaluate.evaluate_checkpoint`) on test.

Same model and training on both sides where recsys has the option: dim, FFN width, blocks,
heads, dropout (RecBole's hidden and attention dropout), max_len, Adam lr, batch size (RecBole:
examples, recsys: rows), full softmax (RecBole ``loss_type = CE``, recsys
``train.next_item.loss = "full"``), seed.

Metrics: HR@10 and NDCG@10 of the test target ranked against every item of the log by the
definition of ``recsys.train.ranking_metrics`` (ties count against the target), both with the
user's history in the ranking (``train_eval``: RecBole's own evaluator's setting for
sequential models) and with every item the user interacted with before the target masked
(``train_eval_masked``: recsys ``train.next_item.exclude_history``; the peer's scores masked the
same way in ``_sasrec_recbole.py``). Both rows of a run come from the same model. RecBole's own
evaluator's Hit@10 / NDCG@10 go to the peer's ``notes``.

Rows (``op``):

- ``train_eval`` / ``train_eval_masked``: per provider and seed, ``hr_at_10``, ``ndcg_at_10``
  and ``wall_s`` (recsys: preprocess + training + its evaluations; peer: the RecBole process,
  data loading included); epochs, the best epoch, why it stopped, rows or examples per epoch,
  threads and the load in ``notes``;
- ``train_step``: one training step (forward, full-softmax loss, backward, Adam) on a fixed batch
  of ``--step-batch`` random histories of max_len items over ml-100k's item count, p20 / p50 /
  p80 ms. recsys learns max_len targets per history, RecBole one (``notes``). The two run in
  separate processes (different environments), one after the other, not interleaved; the load
  average is in ``notes``.

Run: ``python -m benchmarks.sasrec_movielens [--mode accuracy|step|both] [--seeds 0 1 2]
[--providers recsys recbole] [--peer-python /path/to/peer-venv/bin/python]``; rows go to
``benchmarks/results/sasrec_movielens.csv`` (``--out-dir`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torchrec import KeyedJaggedTensor

from benchmarks._harness import (
    REPO_ROOT,
    Timing,
    add_common_args,
    append_csv,
    environment,
    format_table,
    load_note,
    resolve_device,
    summarize,
    time_fns,
)
from benchmarks._movielens import ML_100K, PEER_PIN, find_log, write_interactions_csv
from recsys import EmbeddingCollection, EmbeddingConfig
from recsys.config import PreprocessConfig
from recsys.data.item_vocabulary import FIRST_ID
from recsys.data.sequence_batches import SequenceBatch, SequenceLoader
from recsys.data.sequences import preprocess_interactions
from recsys.embedding.optim import Adam
from recsys.models.next_item import next_item_loss
from recsys.models.sasrec import CANDIDATES, HISTORY, SASRec
from recsys.train.evaluate import evaluate_checkpoint
from recsys.train.metrics import read_metrics

TOPIC = "sasrec_movielens"
PEER = "recbole_sasrec"
PEER_SCRIPT = REPO_ROOT / "benchmarks" / "_sasrec_recbole.py"
PEER_REQUIREMENTS = REPO_ROOT / "requirements" / "peer-sasrec.txt"
COLUMNS = (
    "op",
    "provider",
    "dataset",
    "config",
    "hr_at_10",
    "ndcg_at_10",
    "wall_s",
    "time_p50_ms",
    "time_p20_ms",
    "time_p80_ms",
    "repeats",
    "device",
    "versions",
    "commit",
    "timestamp",
    "notes",
)
PROTOCOL = (
    "leave-one-out by time (file-order ties), full ranking over every item of the log, best "
    "valid NDCG@10 tested"
)


@dataclass(frozen=True)
class SASRecRun:
    """The model and training both sides share (see the module docstring); defaults: RecBole's
    SASRec settings (``properties/model/SASRec.yaml``) with batch 128."""

    max_len: int = 50
    dim: int = 64
    ffn_dim: int = 256
    blocks: int = 2
    heads: int = 2
    dropout: float = 0.5
    epochs: int = 300
    patience: int = 10
    lr: float = 1e-3
    batch_size: int = 128
    loss: str = "full"  # recsys: full or sampled softmax; RecBole: always full (CE)
    train_rows: str = "windows"  # recsys' train.next_item.train_rows
    window_stride: int = 0  # recsys' train.next_item.window_stride (0: max_len)
    seed: int = 0
    extra: tuple[str, ...] = ()  # recsys-only config keys, "section.key=value"

    def describe_model(self) -> str:
        return (
            f"dim {self.dim} ffn {self.ffn_dim} blocks {self.blocks} heads {self.heads} dropout "
            f"{self.dropout} max_len {self.max_len} loss {self.loss}_softmax"
        )

    def describe(self) -> str:
        extra = "".join(f" {item}" for item in self.extra)
        return (
            f"{self.describe_model()} adam lr {self.lr} batch {self.batch_size} up to "
            f"{self.epochs} epochs, patience {self.patience} seed {self.seed}{extra}"
        )


def make_model(
    num_items: int, run: SASRecRun, device: torch.device
) -> tuple[SASRec, torch.optim.Optimizer]:
    """recsys' SASRec with its item table in ``EmbeddingCollection`` (Adam fused into
    backward) and Adam for the dense parameters."""
    torch.manual_seed(run.seed)
    table = EmbeddingConfig(
        name="item",
        num_embeddings=num_items,
        embedding_dim=run.dim,
        feature_names=[HISTORY, CANDIDATES],
    )
    items = EmbeddingCollection([table], device=device, optimizer=Adam(lr=run.lr))
    model = SASRec(
        items,
        max_len=run.max_len,
        num_blocks=run.blocks,
        num_heads=run.heads,
        dropout=run.dropout,
        ffn_dim=run.ffn_dim,
    ).to(device)
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    return model, torch.optim.Adam(dense, lr=run.lr)


# the recsys models a run can train on the split (--recsys-models): model.name and overrides
RECSYS_MODELS = {
    "sasrec": ("sasrec", []),
    "sasrec_post": ("sasrec", ["--model.sequence.layer_norm=post"]),  # RecBole's layout
    "hstu": ("hstu", []),
    "hstu_rab": ("hstu", ["--model.sequence.relative_bias=true"]),
    "hstu_rab_time": (
        "hstu",
        ["--model.sequence.relative_bias=true", "--model.sequence.time_bias=true"],
    ),
    "hstu_rab_time_next": (
        "hstu",
        [
            "--model.sequence.relative_bias=true",
            "--model.sequence.time_bias=true",
            "--model.sequence.time_convention=next",
        ],
    ),
}


def recsys_overrides(
    split_dir: Path, run: SASRecRun, device: torch.device, model: str, steps_per_epoch: int
) -> list[str]:
    """``recsys train``'s command-line overrides for ``model`` (a key of
    :data:`RECSYS_MODELS`) on the split: ``run``'s model and training, valid every epoch,
    the best valid NDCG@10 kept, early stopping after ``run.patience`` evaluations."""
    name, extra = RECSYS_MODELS[model]
    ffn = [f"--model.sequence.ffn_dim={run.ffn_dim}"] if name == "sasrec" else []
    return [
        f"--model.name={name}",
        *extra,
        *ffn,
        f"--model.embedding_dim={run.dim}",
        f"--model.sequence.max_len={run.max_len}",
        f"--model.sequence.num_blocks={run.blocks}",
        f"--model.sequence.num_heads={run.heads}",
        f"--model.sequence.dropout={run.dropout}",
        f"--data.path={split_dir}",
        f"--train.batch_size={run.batch_size}",
        f"--train.epochs={run.epochs}",
        "--train.dense_optimizer=adam",
        f"--train.dense_lr={run.lr}",
        "--train.embedding_optimizer=adam",
        f"--train.embedding_lr={run.lr}",
        f"--train.next_item.loss={run.loss}",
        f"--train.next_item.train_rows={run.train_rows}",
        f"--train.next_item.window_stride={run.window_stride}",
        f"--train.eval_every_steps={steps_per_epoch}",
        f"--train.log_every_steps={steps_per_epoch}",
        f"--train.early_stopping_patience={run.patience}",
        "--train.early_stopping_metric=valid_ndcg@10",
        "--checkpoint.keep_best=valid_ndcg@10",
        "--checkpoint.keep=1",
        "--train.eval_batch_size=512",
        "--train.progress_bar=false",
        "--run.tensorboard=false",
        f"--run.seed={run.seed}",
        f"--run.device={device}",
        *(f"--{item}" for item in run.extra),
    ]


def train_recsys(
    split_dir: Path, run: SASRecRun, device: torch.device, model: str, work: Path, threads: int
) -> dict:
    """``python -m recsys train`` of ``model`` on the split (see :func:`recsys_overrides`) in
    a subprocess with ``threads`` torch threads, then the best checkpoint's test ranking with
    the history in it and masked; metrics, epochs and seconds."""
    loader = SequenceLoader(
        split_dir,
        "train",
        run.batch_size,
        max_len=run.max_len,
        train_rows=run.train_rows,
        window_stride=run.window_stride,
    )
    steps_per_epoch = len(loader)
    run_dir = work / f"run_{model}_{run.seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "recsys", "train"]
    command += recsys_overrides(split_dir, run, device, model, steps_per_epoch)
    command.append(f"--run.dir={run_dir}")
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO_ROOT)
    train_s = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"recsys train failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
    events = read_metrics(run_dir / "metrics.jsonl")
    valid = [e for e in events if e["split"] == "valid"]
    best = max(valid, key=lambda e: e["ndcg@10"])  # the first of equals: keep_best's choice
    steps = max(e["step"] for e in events if "step" in e)
    result = {
        "steps": steps,
        "steps_per_epoch": steps_per_epoch,
        "rows_per_epoch": loader.rows,
        "epochs": math.ceil(steps / steps_per_epoch),
        "best_epoch": best["step"] // steps_per_epoch,
        "stopped_by": "epochs" if steps == run.epochs * steps_per_epoch else "early_stopping",
        "train_s": train_s,
    }
    for kind, masked in (("unmasked", "false"), ("masked", "true")):
        overrides = [f"--train.next_item.exclude_history={masked}", f"--run.device={device}"]
        test = evaluate_checkpoint(run_dir / "checkpoints" / "best", overrides).metrics
        result.update({f"{kind}_{k}": test[k] for k in ("hr@10", "ndcg@10", "mrr")})
    result["wall_s"] = time.perf_counter() - started
    return result


def preprocess(csv_path: Path, split_dir: Path) -> dict:
    """``recsys preprocess --format interactions`` of the log (whole histories, every item of
    the log in the vocabulary, as RecBole ranks); its metadata.json."""
    config = PreprocessConfig(
        format="interactions",
        input=str(csv_path),
        output=str(split_dir),
        user="user",
        item="item",
        time="time",
        item_universe="log",
        overwrite=True,
    )
    return preprocess_interactions(config).metadata


def peer_python(option: str | None) -> Path | None:
    """The peer environment's python (--peer-python, else $RECSYS_PEER_PYTHON), checked to
    import RecBole; None (with the reason printed) when there is none."""
    given = option or os.environ.get("RECSYS_PEER_PYTHON")
    how = (
        f"install the peer into its own environment: python -m venv /path/peer-venv && "
        f"/path/peer-venv/bin/pip install -r {PEER_REQUIREMENTS.relative_to(REPO_ROOT)}, then "
        "pass --peer-python /path/peer-venv/bin/python"
    )
    if not given:
        print(f"peer rows skipped: no peer environment given ({how})")
        return None
    check = subprocess.run([given, "-c", "import recbole"], capture_output=True, text=True)
    if check.returncode:
        raise SystemExit(
            f"--peer-python {given} cannot import recbole: {check.stderr[-500:]}\n{how}"
        )
    return Path(given)


def run_peer(python: Path, mode: str, options: dict, work: Path) -> dict:
    """Run ``_sasrec_recbole.py`` in the peer environment (working directory ``work``: RecBole
    writes its tensorboard and checkpoint folders there); its JSON result."""
    out = work / f"peer_{mode}.json"
    command = [str(python), str(PEER_SCRIPT), *peer_argv(mode, options, out)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the peer failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def peer_argv(mode: str, options: dict, out: Path) -> list[str]:
    """``_sasrec_recbole.py``'s command line for ``mode`` with ``options`` (None: left out)."""
    argv = [mode, "--out", str(out)]
    for key, value in options.items():
        if value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def peer_options(run: SASRecRun, threads: int, device: torch.device) -> dict:
    """``_sasrec_recbole.py``'s options for ``run``: the same model and training."""
    options = asdict(run)
    for name in ("loss", "train_rows", "window_stride", "patience", "extra"):  # recsys' only
        options.pop(name)
    options["stopping_step"] = run.patience
    options["threads"] = threads
    options["device"] = device.type
    return options


def accuracy_rows(
    args: argparse.Namespace, base: SASRecRun, work: Path, env: dict, peer: Path | None
) -> list[list]:
    log = find_log(ML_100K, args.wheel, peer)
    lines = []
    dataset = f"{ML_100K.name}.inter ({ML_100K.package}): {PROTOCOL}"
    threads = f"threads={args.threads or torch.get_num_threads()}"
    for seed in args.seeds:
        run = replace(base, seed=seed)
        if "recsys" in args.providers:
            csv_path = work / "ml-100k.csv"
            events = write_interactions_csv(log, csv_path)
            for model in args.recsys_models:
                load, started = load_note(), time.perf_counter()
                metadata = preprocess(csv_path, work / "split")
                prep_s = time.perf_counter() - started
                ours = train_recsys(work / "split", run, args.device, model, work, args.threads)
                items = metadata["sequence"]["num_items"] - FIRST_ID
                notes = (
                    f"{events} events, {items} items; train_rows={run.train_rows} window_stride="
                    f"{run.window_stride or run.max_len}: "
                    f"{ours['rows_per_epoch']} rows ({ours['steps_per_epoch']} steps) per epoch; "
                    f"epochs={ours['epochs']} best_epoch={ours['best_epoch']} stopped_by="
                    f"{ours['stopped_by']} preprocess_s={prep_s:.1f} train_s={ours['train_s']:.1f}"
                    f"; {threads}; {load}"
                )
                provider = "recsys" if model == "sasrec" else f"recsys_{model}"
                config = run.describe() if model == "sasrec" else f"{model}: {run.describe()}"
                wall = prep_s + ours["wall_s"]
                lines += _accuracy_lines(provider, dataset, config, ours, wall, env, notes)
        if "recbole" in args.providers and peer is not None:
            data_dir = work / "atomic"
            (data_dir / ML_100K.name).mkdir(parents=True, exist_ok=True)
            (data_dir / ML_100K.name / f"{ML_100K.name}.inter").write_bytes(log)
            options = peer_options(run, args.threads, args.device)
            options.update(data_dir=data_dir, name=ML_100K.name, budget_s=args.budget_s)
            load = load_note()
            theirs = run_peer(peer, "fit_log", options, work)
            notes = (
                f"{theirs['items']} items; {theirs['train_examples']} examples per epoch; "
                f"epochs={theirs['epochs']} best_epoch={theirs['best_epoch']} stopped_by="
                f"{theirs['stopped_by']} budget_s={args.budget_s:g} train_s="
                f"{theirs['train_s']:.1f} recbole_evaluator_hit@10={theirs['recbole_hit@10']:.4f}"
                f" recbole_evaluator_ndcg@10={theirs['recbole_ndcg@10']:.4f} {theirs['versions']}"
                f"; {threads}; {load}"
            )
            lines += _accuracy_lines(
                PEER,
                dataset,
                replace(run, extra=()).describe(),
                theirs,
                theirs["wall_s"],
                env,
                notes,
            )
    return lines


def _accuracy_lines(provider, dataset, config, result, wall_s, env, notes) -> list[list]:
    """The ``train_eval`` (history in the ranking) and ``train_eval_masked`` rows of a run."""
    return [
        [
            op,
            provider,
            dataset,
            config,
            f"{result[f'{kind}_hr@10']:.4f}",
            f"{result[f'{kind}_ndcg@10']:.4f}",
            f"{wall_s:.1f}",
            "",
            "",
            "",
            "",
            env["device"],
            env["versions"],
            env["commit"],
            env["timestamp"],
            f"{notes}; mrr={result[f'{kind}_mrr']:.4f}",
        ]
        for op, kind in (("train_eval", "unmasked"), ("train_eval_masked", "masked"))
    ]


def step_batch(batch: int, max_len: int, num_items: int, seed: int) -> SequenceBatch:
    """A train batch of ``batch`` random histories of ``max_len`` + 1 items (``max_len`` read,
    ``max_len`` next-item targets), ids in [FIRST_ID, num_items)."""
    generator = torch.Generator().manual_seed(seed)
    events = torch.randint(FIRST_ID, num_items, (batch, max_len + 1), generator=generator)
    total = batch * max_len
    items = KeyedJaggedTensor(
        keys=["items"],
        values=events[:, :-1].reshape(-1),
        lengths=torch.full((batch,), max_len),
        stride=batch,
        length_per_key=[total],
        offset_per_key=[0, total],
    )
    times = torch.zeros(total, dtype=torch.float64)
    return SequenceBatch(items, times, events[:, 1:].reshape(-1), max_len, True)


def recsys_step(run: SASRecRun, num_items: int, device: torch.device) -> Callable[[], None]:
    """One training step of recsys' SASRec on a fixed :func:`step_batch` of ``run``'s shape."""
    model, optimizer = make_model(num_items, run, device)
    batch = step_batch(run.batch_size, run.max_len, num_items, run.seed).to(device)
    generator = torch.Generator().manual_seed(run.seed)
    model.train()

    def one_step() -> None:
        full = run.loss == "full"
        loss = next_item_loss(
            model, batch, full_softmax=full, first_item=FIRST_ID, generator=generator
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return one_step


def step_rows(
    args: argparse.Namespace, base: SASRecRun, work: Path, env: dict, peer: Path | None
) -> list[list]:
    num_items = args.step_items
    lines = []
    for max_len in args.step_lens:
        run = replace(base, max_len=max_len, batch_size=args.step_batch)
        one_step = recsys_step(run, num_items, args.device)
        load = load_note()
        timing = time_fns(
            {"recsys": one_step}, args.device, warmup=args.warmup, repeats=args.repeats
        )
        timings = {"recsys": timing["recsys"]}
        notes = {"recsys": f"targets/step={args.step_batch * max_len}; {load}"}
        if peer is not None:
            load = load_note()
            options = peer_options(run, args.threads, args.device)
            options.update(num_items=num_items, warmup=args.warmup, repeats=args.repeats)
            result = run_peer(peer, "step", options, work)
            timings[PEER] = summarize(result["times_ms"])
            notes[PEER] = f"targets/step={args.step_batch}; {result['versions']}; {load}"
        config = (
            f"{run.describe_model()} adam lr {run.lr} (random histories, "
            f"{num_items - FIRST_ID} items, batch {args.step_batch} x max_len {max_len})"
        )
        lines += [_step_line(p, config, t, env, notes[p]) for p, t in timings.items()]
    return lines


def _step_line(provider: str, config: str, timing: Timing, env: dict, notes: str) -> list:
    return [
        "train_step",
        provider,
        "random histories",
        config,
        "",
        "",
        "",
        f"{timing.p50_ms:.4f}",
        f"{timing.p20_ms:.4f}",
        f"{timing.p80_ms:.4f}",
        timing.repeats,
        env["device"],
        env["versions"],
        env["commit"],
        env["timestamp"],
        notes,
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = SASRecRun()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["accuracy", "step", "both"], default="both")
    parser.add_argument("--peer-python", default=None, help="python of the RecBole environment")
    parser.add_argument("--wheel", type=Path, default=None, help=f"a {PEER_PIN} wheel (the log)")
    parser.add_argument(
        "--providers",
        nargs="+",
        choices=["recsys", "recbole"],
        default=["recsys", "recbole"],
        help="accuracy: who trains (recbole needs --peer-python)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[defaults.seed])
    parser.add_argument("--max-len", type=int, default=defaults.max_len)
    parser.add_argument("--dim", type=int, default=defaults.dim)
    parser.add_argument("--ffn-dim", type=int, default=defaults.ffn_dim)
    parser.add_argument("--blocks", type=int, default=defaults.blocks)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--dropout", type=float, default=defaults.dropout)
    parser.add_argument("--epochs", type=int, default=defaults.epochs, help="at most")
    parser.add_argument(
        "--patience", type=int, default=defaults.patience, help="evaluations without a better"
    )
    parser.add_argument(
        "--budget-s", type=float, default=1440, help="RecBole's wall budget (0: none)"
    )
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--loss", choices=["full", "sampled"], default=defaults.loss)
    parser.add_argument(
        "--train-rows",
        choices=["windows", "prefixes", "last"],
        default=defaults.train_rows,
        help="recsys' train.next_item.train_rows",
    )
    parser.add_argument(
        "--window-stride",
        type=int,
        default=defaults.window_stride,
        help="recsys' train.next_item.window_stride (0: max_len)",
    )
    parser.add_argument(
        "--recsys-models",
        nargs="+",
        choices=list(RECSYS_MODELS),
        default=["sasrec"],
        help="recsys models trained on the split (sasrec_post: SASRec with RecBole's layout, "
        "model.sequence.layer_norm = post; hstu: HSTU, the FFN width unused; hstu_rab: "
        "with the relative position bias; hstu_rab_time: with the position + time bias, the "
        "query's own time; hstu_rab_time_next: the next event's time, as Meta's HSTU)",
    )
    parser.add_argument(
        "--recsys-set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a recsys-only config key for recsys' runs (RecBole has no such option), e.g. "
        "train.lr_schedule=cosine; written into the rows' config (--mode accuracy only)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--step-lens", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--step-batch", type=int, default=128)
    parser.add_argument("--step-items", type=int, default=1681, help="ml-100k's item count")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary one")
    add_common_args(parser)
    args = parser.parse_args(argv)
    args.warmup = 2 if args.warmup is None else args.warmup
    args.repeats = 10 if args.repeats is None else args.repeats
    for item in args.recsys_set:
        key, equals, _ = item.partition("=")
        if not equals or "." not in key:
            raise SystemExit(f"--recsys-set {item!r}: expected SECTION.KEY=VALUE")
    if args.recsys_set and args.mode != "accuracy":
        raise SystemExit(
            f"--recsys-set applies to recsys train (--mode accuracy); --mode {args.mode}'s step "
            "rows time SASRec as built with its defaults: pass --mode accuracy"
        )
    for name in ("max_len", "dim", "blocks", "heads", "epochs", "batch_size", "step_batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)}: expected >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    run = SASRecRun(
        max_len=args.max_len,
        dim=args.dim,
        ffn_dim=args.ffn_dim,
        blocks=args.blocks,
        heads=args.heads,
        dropout=args.dropout,
        epochs=args.epochs,
        patience=args.patience,
        lr=args.lr,
        batch_size=args.batch_size,
        loss=args.loss,
        train_rows=args.train_rows,
        window_stride=args.window_stride,
        extra=tuple(args.recsys_set),
    )
    peer = peer_python(args.peer_python)
    env = environment(args.device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    with tempfile.TemporaryDirectory(prefix="bench_sasrec_") as temporary:
        work = args.work_dir or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        lines = []
        if args.mode in ("accuracy", "both"):
            try:
                lines += accuracy_rows(args, run, work, env, peer)
            except SystemExit as missing:  # no log: --mode both still takes the step rows
                if args.mode == "accuracy":
                    raise
                print(f"accuracy rows skipped: {missing}")
        if args.mode in ("step", "both"):
            lines += step_rows(args, run, work, env, peer)
    path = append_csv(TOPIC, COLUMNS, lines, args.out_dir)
    table = [[line[0], line[1], line[4], line[5], line[6], line[7]] for line in lines]
    print(format_table(["op", "provider", "HR@10", "NDCG@10", "wall s", "step p50 ms"], table))
    print(f"{len(lines)} rows appended to {path}")


if __name__ == "__main__":
    main()
