"""SASRec on a real log: recsys against RecBole's SASRec on the same MovieLens leave-one-out
split, same metrics; and the training step of both at max_len 50 and 200.

Data (``benchmarks/_movielens.py``): MovieLens 100K as the ``recbole==1.2.1`` wheel ships it,
read from the installed package or the wheel (``--wheel``); nothing is downloaded. ``recsys
preprocess --format interactions --max-len L`` makes the split (per user in time order: test
predicts the last event, valid the one before, train holds the rest, its last L + 1 events).

Peer: RecBole 1.2.1's ``SASRec`` (RUCAIBox/RecBole, MIT), trained by RecBole's ``Trainer`` in its
own environment (``requirements/peer-sasrec.txt``; ``--peer-python`` or ``$RECSYS_PEER_PYTHON``
names that environment's python; without it the peer rows are skipped with a note). It reads the
recsys split exported as pre-split atomic files: each recsys train row e_1 .. e_m becomes the
m - 1 examples (e_1 .. e_t -> e_(t+1)) that recsys' causal model learns from it, valid and test
rows one example each, item tokens = recsys ids, and RecBole's corpus = recsys' (ids >= 3).

Same model size and training on both sides: dim, FFN width, blocks, heads, dropout (RecBole's
hidden and attention dropout), max_len, epochs, Adam lr, seed; the loss is full softmax on both
(RecBole ``loss_type = CE``; recsys ``train.next_item.loss = "full"``, ``--loss sampled`` for
its default sampled softmax). The recsys side is ``recsys train`` (the trainer in this process,
``model.name = "sasrec"`` over ``data.path`` = the split, no valid evaluation, the test ranking
at the end). A recsys batch is ``--batch-size`` train rows, each with up to
max_len next-item targets; a RecBole batch is ``--peer-batch-size`` examples of one target each
(its unit). By default the peer's batch is sized so that both take the same number of steps per
epoch, so at equal epochs both see every target as often, in as many Adam steps, with about as
many targets per step (``--peer-batch-size 2048``: RecBole's own default). Fixed epochs, no early
stopping (valid is exported but neither side selects on it), the final model is tested.

Metrics: HR@10 and NDCG@10 of full-corpus ranking by the definition of
``recsys.train.ranking_metrics`` for both (every item id >= 3 a candidate, ties against the
target, the user's history not excluded, as RecBole does for sequential models; a test target
unseen in training is a miss). The peer's scores are ranked by the same definition in
``_sasrec_recbole.py``; RecBole's own evaluator's Hit@10 / NDCG@10 (its corpus also holds the
unseen targets) go to ``notes``.

Rows (``op``):

- ``train_eval``: per provider, ``hr_at_10``, ``ndcg_at_10`` and ``wall_s`` (recsys:
  preprocess + training + test; peer: export + the RecBole process, its data loading included);
  train / eval seconds and steps in ``notes``;
- ``train_step``: one training step (forward, full-softmax loss, backward, Adam) on a fixed batch
  of ``--step-batch`` random histories of max_len items over ml-100k's item count, p20 / p50 /
  p80 ms. recsys learns max_len targets per history, RecBole one (``notes``). The two run in
  separate processes (different environments), one after the other, not interleaved; the load
  average is in ``notes``.

Run: ``python -m benchmarks.sasrec_movielens [--mode accuracy|step|both] [--epochs N]
[--peer-python /path/to/peer-venv/bin/python]``; rows go to
``benchmarks/results/sasrec_movielens.csv`` (``--out-dir`` elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import subprocess
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
    is_quick,
    load_note,
    resolve_device,
    summarize,
    time_fns,
)
from benchmarks._movielens import (
    ML_100K,
    PEER_PIN,
    export_recbole,
    find_log,
    write_interactions_csv,
)
from recsys import EmbeddingCollection, EmbeddingConfig
from recsys.config import PreprocessConfig, load_config
from recsys.data.sequence_batches import SequenceBatch
from recsys.data.sequences import FIRST_ID, preprocess_interactions
from recsys.embedding.optim import Adam
from recsys.models.next_item import next_item_loss
from recsys.models.sasrec import CANDIDATES, HISTORY, SASRec
from recsys.train.trainer import train

TOPIC = "sasrec_movielens"
QUICK_EPOCHS, FULL_EPOCHS = 5, 50
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


@dataclass(frozen=True)
class SASRecRun:
    """The model and training both sides share (see the module docstring)."""

    max_len: int = 50
    dim: int = 64
    ffn_dim: int = 256
    blocks: int = 2
    heads: int = 2
    dropout: float = 0.2
    epochs: int = 5
    lr: float = 1e-3
    batch_size: int = 128
    loss: str = "full"  # recsys: full or sampled softmax; RecBole: always full (CE)
    seed: int = 0
    peer_batch_size: int = 0  # RecBole examples per batch; 0: as many steps per epoch as recsys

    def describe_model(self) -> str:
        return (
            f"dim {self.dim} ffn {self.ffn_dim} blocks {self.blocks} heads {self.heads} dropout "
            f"{self.dropout} max_len {self.max_len} loss {self.loss}_softmax"
        )

    def describe(self) -> str:
        peer = f" peer batch {self.peer_batch_size}" if self.peer_batch_size else ""
        return (
            f"{self.describe_model()} epochs {self.epochs} adam lr {self.lr} batch "
            f"{self.batch_size}{peer} seed {self.seed}"
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
    "hstu": ("hstu", []),
    "hstu_rab": ("hstu", ["--model.sequence.relative_bias=true"]),
    "hstu_rab_time": (
        "hstu",
        ["--model.sequence.relative_bias=true", "--model.sequence.time_bias=true"],
    ),
}


def train_recsys(
    split_dir: Path, run: SASRecRun, device: torch.device, model: str = "sasrec"
) -> dict[str, float]:
    """``recsys train`` of ``model`` (a key of :data:`RECSYS_MODELS`; SASRec by default) on the
    histories in ``split_dir`` for ``run.epochs`` epochs (the run's config below, the FFN width
    for SASRec only; no valid evaluation, no checkpoint), ranking every item for each test user
    at the end; HR@10, NDCG@10, MRR, steps and seconds."""
    name, extra = RECSYS_MODELS[model]
    ffn = [f"--model.sequence.ffn_dim={run.ffn_dim}"] if name == "sasrec" else []
    overrides = [
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
        "--train.eval_every_steps=0",
        "--train.eval_batch_size=512",
        "--train.progress_bar=false",
        "--checkpoint.save_final=false",
        "--run.tensorboard=false",
        f"--run.seed={run.seed}",
        f"--run.device={device}",
    ]
    with tempfile.TemporaryDirectory(prefix="sasrec-run-") as run_dir:
        config = load_config(None, [*overrides, f"--run.dir={run_dir}"])
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            result = train(config)
        seconds = time.perf_counter() - started
    test = result.test
    return {
        "hr@10": test["hr@10"],
        "ndcg@10": test["ndcg@10"],
        "mrr": test["mrr"],
        "steps": result.steps,
        "train_s": seconds,  # the whole run: training and the test ranking
        "eval_s": 0.0,
    }


def preprocess(csv_path: Path, split_dir: Path, max_len: int) -> dict:
    """``recsys preprocess --format interactions`` of the log; its metadata.json."""
    config = PreprocessConfig(
        format="interactions",
        input=str(csv_path),
        output=str(split_dir),
        user="user",
        item="item",
        time="time",
        max_len=max_len,
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
    command = [str(python), str(PEER_SCRIPT), mode, "--out", str(out)]
    for key, value in options.items():
        if value is not None:
            command += [f"--{key.replace('_', '-')}", str(value)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the peer failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def peer_options(run: SASRecRun, threads: int, device: torch.device) -> dict:
    """``_sasrec_recbole.py``'s options for ``run``: the same model and training, with the
    peer's batch size."""
    options = asdict(run)
    options.pop("loss")
    options["batch_size"] = options.pop("peer_batch_size") or run.batch_size
    options["threads"] = threads
    options["device"] = device.type
    return options


def accuracy_rows(
    args: argparse.Namespace, run: SASRecRun, work: Path, env: dict, peer: Path | None
) -> list[list]:
    log = find_log(ML_100K, args.wheel, peer)
    csv_path = work / "ml-100k.csv"
    events = write_interactions_csv(log, csv_path)
    print(f"{ML_100K.name}: {events:,} interactions from {ML_100K.package}:{ML_100K.member}")
    load = load_note()
    started = time.perf_counter()
    split_dir = work / "split"
    metadata = preprocess(csv_path, split_dir, run.max_len)
    prep_s = time.perf_counter() - started
    num_items = metadata["sequence"]["num_items"]
    dataset = (
        f"{ML_100K.name} ({ML_100K.package}) leave-one-out: {metadata['input']['users']} users, "
        f"{num_items - FIRST_ID} train items, {metadata['input']['interactions']} events"
    )
    lines = []
    for model in args.recsys_models:
        ours = train_recsys(split_dir, run, args.device, model)
        ours_wall = time.perf_counter() - started
        lines.append(
            _accuracy_line(
                "recsys" if model == "sasrec" else f"recsys_{model}",
                dataset,
                run.describe() if model == "sasrec" else f"{model}: {run.describe()}",
                ours,
                ours_wall,
                env,
                f"preprocess_s={prep_s:.1f} train_s={ours['train_s']:.1f} eval_s="
                f"{ours['eval_s']:.1f} steps={ours['steps']} mrr={ours['mrr']:.4f}; {load}",
            )
        )
        load, started = load_note(), time.perf_counter() - prep_s
    if peer is not None:
        load = load_note()
        started = time.perf_counter()
        exported = export_recbole(split_dir, work / "atomic", "recsys_split", num_items)
        if not run.peer_batch_size:  # as many steps per epoch as recsys takes
            steps = max(1, metadata["splits"]["train"]["rows"] // run.batch_size)
            run = replace(run, peer_batch_size=math.ceil(exported["train"] / steps))
        config = run.describe()
        options = peer_options(run, args.threads, args.device)
        options.update(data_dir=work / "atomic", name="recsys_split", num_items=num_items)
        theirs = run_peer(peer, "fit", options, work)
        peer_wall = time.perf_counter() - started
        notes = (
            f"train_s={theirs['train_s']:.1f} eval_s={theirs['eval_s']:.1f} steps="
            f"{theirs['steps']} train_examples={exported['train']} mrr={theirs['mrr']:.4f} "
            f"recbole_evaluator_hit@10={theirs['recbole_hit@10']:.4f} recbole_evaluator_ndcg@10="
            f"{theirs['recbole_ndcg@10']:.4f} {theirs['versions']}; {load}"
        )
        lines.append(_accuracy_line(PEER, dataset, config, theirs, peer_wall, env, notes))
    return lines


def _accuracy_line(provider, dataset, config, result, wall_s, env, notes) -> list:
    return [
        "train_eval",
        provider,
        dataset,
        config,
        f"{result['hr@10']:.4f}",
        f"{result['ndcg@10']:.4f}",
        f"{wall_s:.1f}",
        "",
        "",
        "",
        "",
        env["device"],
        env["versions"],
        env["commit"],
        env["timestamp"],
        notes,
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
        run = replace(base, max_len=max_len, batch_size=args.step_batch, peer_batch_size=0)
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
    parser.add_argument("--max-len", type=int, default=defaults.max_len)
    parser.add_argument("--dim", type=int, default=defaults.dim)
    parser.add_argument("--ffn-dim", type=int, default=defaults.ffn_dim)
    parser.add_argument("--blocks", type=int, default=defaults.blocks)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--dropout", type=float, default=defaults.dropout)
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help=f"default {QUICK_EPOCHS} (--quick, the default on cpu), {FULL_EPOCHS} (--full)",
    )
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument(
        "--peer-batch-size",
        type=int,
        default=0,
        help="RecBole examples per batch (default: as many steps per epoch as recsys)",
    )
    parser.add_argument("--loss", choices=["full", "sampled"], default=defaults.loss)
    parser.add_argument(
        "--recsys-models",
        nargs="+",
        choices=list(RECSYS_MODELS),
        default=["sasrec"],
        help="recsys models trained on the split (hstu: HSTU, the FFN width unused; hstu_rab: "
        "with the relative position bias; hstu_rab_time: with the position + time bias)",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--step-lens", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--step-batch", type=int, default=128)
    parser.add_argument("--step-items", type=int, default=1681, help="ml-100k's item count")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary one")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.epochs is None:
        args.epochs = QUICK_EPOCHS if is_quick(args) else FULL_EPOCHS
    args.warmup = 2 if args.warmup is None else args.warmup
    args.repeats = 10 if args.repeats is None else args.repeats
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
        lr=args.lr,
        batch_size=args.batch_size,
        loss=args.loss,
        seed=args.seed,
        peer_batch_size=args.peer_batch_size,
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
