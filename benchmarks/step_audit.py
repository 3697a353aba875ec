"""Benchmark what one training step makes the host wait for, beside how long the step takes:
host-device syncs, kernel-like ops and collectives per steady-state step (counted by
``recsys.train.step_audit.StepAudit``, the same way for every provider) and the step time.

Model: the default recipe's (``configs/dlrm_synthetic.toml``: DLRM, 13 dense and 26
categorical features, tables of dim 16, Adam on the dense part, Adagrad on the tables).

Providers:

- ``recsys``: a real ``recsys train`` run of the recipe (``recsys.train.trainer.train_steps``),
  fixed tables, one process, the loader in its background thread (``data.prefetch_batches=2``);
  a step is one step of the trainer's loop (the train step and what the loop does around it:
  the next batch from the loader, the schedule, the loss window).
- ``recsys_dynamic``: the same run with every table dynamic (``model.dynamic.tables=["all"]``):
  fresh samples every step, so most steps bring new keys to some tables (the audited step, the
  fourth, still grows tables). The step of hits only and a step that inserts after the growth
  are audited by ``tests/train/test_step_budget.py`` (``step_audit_budget.json``), the step time
  of hits by ``benchmarks/dynamic.py``.
- ``recsys_sharded``: the same run on 2 gloo ranks (``torch.multiprocessing`` processes, one
  torch thread each; the planner's plan, DDP on the dense part); counts of rank 0 (rank 1's in
  ``notes`` where they differ), the slower rank's step time, batch per rank. CPU only (not
  run with ``--device cuda``).
- ``recsys_model_step``: the recipe's model and optimizers (``build_model``,
  ``build_optimizers``) stepped by a plain loop (forward, BCE, backward, optimizer steps) on
  batches built beforehand: the loop the TorchRec peer runs, without the trainer and loader.
- ``torchrec_dmp``: ``torchrec.models.dlrm.DLRM`` under ``DistributedModelParallel`` (world of
  one, gloo), every table TABLE_WISE on FBGEMM's TBE with EXACT_ADAGRAD fused into backward,
  ``torch.optim.Adam`` on the dense part, the same plain loop on the same prebuilt batches
  (``benchmarks/_torchrec_peers.py``, ``benchmarks/models.py``).

Batch sizes 32, 256 and 2048 for ``recsys``, ``recsys_model_step`` and ``torchrec_dmp``;
``recsys_dynamic`` and ``recsys_sharded`` at 2048 (the recipe's batch). Each provider warms up
(3 steps), one step is audited, then steps are timed (``benchmarks/_harness.py``; CUDA events
on a GPU): the providers of one batch size in alternation, each trainer step followed by an
untimed pause as long as itself, in which its loader thread builds the next batch (rather than
during the next provider's step); the ranks in processes of their own, before the rest.
``notes``: the files of the syncs (``file xN``), the load average.

Run: ``python -m benchmarks.step_audit [--quick] [--device cuda]``; rows go to
``benchmarks/results/step_audit.csv``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

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
    time_fns,
)
from benchmarks.models import recsys_model, torchrec_dmp
from recsys.config import Config, load_config
from recsys.data import build_dataset
from recsys.data.loader import BatchLoader
from recsys.train.step_audit import AuditReport, StepAudit
from recsys.train.trainer import train_steps

TOPIC = "step_audit"
RECIPE = REPO_ROOT / "configs" / "dlrm_synthetic.toml"
BATCH_SIZES = (32, 256, 2048)
RECIPE_BATCH = 2048
WARMUP = 3
NUM_PREBUILT = 8  # batches built beforehand for the plain loops, cycled
SHARDED_RANKS = 2
COLUMNS = (
    "provider",
    "config",
    "batch",
    "ranks",
    "syncs",
    "kernel_ops",
    "collectives",
    "time_p50_ms",
    "time_p20_ms",
    "time_p80_ms",
    "repeats",
    "samples_per_s",
    "device",
    "versions",
    "commit",
    "timestamp",
    "notes",
)

Step = Callable[[], object]
# Where TorchRec's count differs from a GPU's: DMP wraps the dense part in DDP with
# static_graph, whose reducer reads (C++, Reducer::finalize_bucket_dense) its host-side map of
# used parameters once per dense parameter during backward.
DDP_NOTE = (
    "includes one sync per dense parameter at loss.backward(): DDP (static_graph) reading its "
    "host-side used-parameter map, no device sync on a GPU"
)


def run_overrides(run_dir: str, device: torch.device, batch: int, steps: int) -> list[str]:
    """The recipe at ``batch`` per rank with data for more than ``steps`` steps and nothing but
    train steps in them (no log event, evaluation or checkpoint)."""
    return [
        f"--run.dir={run_dir}",
        f"--run.device={device.type}",
        "--train.progress_bar=false",
        f"--train.batch_size={batch}",
        f"--train.log_every_steps={10 * steps}",
        "--train.eval_every_steps=0",
        "--checkpoint.save_final=false",
        "--data.prefetch_batches=2",
        '--train.id_checks="async"',  # what a GPU run does ("auto"); sharded tables stay sync
        f"--data.synthetic.num_train_samples={batch * SHARDED_RANKS * (steps + 20)}",
        "--data.synthetic.num_valid_samples=2048",
        "--data.synthetic.num_test_samples=2048",
    ]


@contextlib.contextmanager
def trainer_run(config: Config) -> Iterator[Step]:
    """``next()`` of the run's steps; the run closed on exit."""
    run = train_steps(config)
    try:
        yield lambda: next(run)
    finally:
        run.close()


def audit(step: Step, device: torch.device, warmup: int = WARMUP) -> AuditReport:
    """``warmup`` steps, then one audited."""
    for _ in range(warmup):
        step()
    with StepAudit(device) as report:
        step()
    return report


def short_path(site: str) -> str:
    """A site's file, relative to site-packages for a library's, to the repository for ours."""
    path = site.rsplit(":", 1)[0]
    path = path.split("site-packages/", 1)[-1]
    return path.removeprefix(f"{REPO_ROOT}/")


def counts(report: AuditReport) -> dict[str, Any]:
    files = Counter(short_path(site) for _, site in report.syncs)
    return {
        "syncs": report.num_syncs,
        "ops": report.num_ops,
        "collectives": report.num_collectives,
        "sync_files": "; ".join(f"{path} x{n}" for path, n in files.most_common()),
    }


def result(
    provider: str, batch: int, ranks: int, audited: dict[str, Any], timing: Timing, note: str = ""
) -> dict[str, Any]:
    return {
        "provider": provider,
        "batch": batch,
        "ranks": ranks,
        **audited,
        "timing": timing,
        "notes": "; ".join(part for part in (note, audited["sync_files"]) if part),
    }


# --- one process --------------------------------------------------------------------------------


class Paced:
    """A trainer's step, and a pause as long as its last step (a provider of its own, whose
    time is dropped) in which the run's loader thread builds the next batch, rather than
    during whichever step the round times next."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self.last_s = 0.0

    def __call__(self) -> None:
        start = time.perf_counter()
        self.step()
        self.last_s = time.perf_counter() - start

    def pause(self) -> None:
        time.sleep(self.last_s)


def bench_one_process(device: torch.device, batch_sizes: list[int], repeats: int) -> list[dict]:
    """Per batch size, in alternation: recsys under the trainer (and recsys_dynamic at the
    recipe batch), recsys_model_step and torchrec_dmp on prebuilt batches."""
    steps = WARMUP + 2 + repeats
    recipe = load_config(RECIPE, [f"--run.device={device.type}"])
    dataset = build_dataset(recipe.data, recipe.run.seed)
    trainers = [(batch, "recsys", ()) for batch in batch_sizes]
    if RECIPE_BATCH in batch_sizes:
        trainers.append((RECIPE_BATCH, "recsys_dynamic", ('--model.dynamic.tables=["all"]',)))
    results = []
    with contextlib.ExitStack() as stack:
        paced, audited = {}, {}
        # Each run starts (and is audited) before TorchRec's DMP opens its process group of one
        # in this process, and is closed after the DMP closed it: a run of one rank leaves
        # alone a process group it did not open only when none is open at its start and end.
        for batch, provider, extra in trainers:
            run_dir = stack.enter_context(tempfile.TemporaryDirectory())
            config = load_config(RECIPE, [*run_overrides(run_dir, device, batch, steps), *extra])
            step = stack.enter_context(trainer_run(config))
            audited[provider, batch] = counts(audit(step, device))
            paced[provider, batch] = Paced(step)
        loops = {
            "recsys_model_step": stack.enter_context(recsys_model(recipe, dataset.spec, device)),
            "torchrec_dmp": stack.enter_context(torchrec_dmp(recipe, dataset.spec, device)),
        }
        for batch in batch_sizes:
            fns: dict[str, Step] = {}
            for (provider, size), run in paced.items():
                if size == batch:
                    fns[provider] = run
                    fns[f"{provider} pause"] = run.pause
            loader = BatchLoader(dataset, "train", batch, drop_last=True, device=device)
            batches = list(itertools.islice(loader, NUM_PREBUILT))
            for provider, loop_step in loops.items():
                cycle = itertools.cycle(batches)
                fns[provider] = lambda s=loop_step, c=cycle: s(next(c))
                audited[provider, batch] = counts(audit(fns[provider], device))
            load = load_note()
            timings = time_fns(fns, device, warmup=1, repeats=repeats, min_time_s=0)
            for provider, timing in timings.items():
                if provider.endswith(" pause"):
                    continue
                note = load if (provider, batch) in paced else f"{load}; prebuilt batches"
                if provider == "torchrec_dmp":
                    note += f"; {DDP_NOTE}"
                results.append(result(provider, batch, 1, audited[provider, batch], timing, note))
                print(f"  {provider} batch {batch}: {timing.p50_ms:.2f} ms", flush=True)
    return results


# --- 2 gloo ranks -------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, out: str, batch: int, repeats: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device("cpu")
    steps = WARMUP + 2 + repeats
    config = load_config(RECIPE, run_overrides(str(Path(out, "run")), device, batch, steps))
    with trainer_run(config) as step:  # joins the process group, leaves it on exit
        audited = counts(audit(step, device))
        timing = time_fns({"step": step}, device, warmup=1, repeats=repeats, min_time_s=0)
    timing = timing["step"]
    Path(out, f"rank{rank}.json").write_text(json.dumps({**audited, "timing": vars(timing)}))


def bench_sharded(batch: int, repeats: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    load = load_note()
    with tempfile.TemporaryDirectory() as out:
        args = (SHARDED_RANKS, port, out, batch, repeats)
        mp.spawn(_rank_main, args=args, nprocs=SHARDED_RANKS, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(SHARDED_RANKS)]
    slowest = max(ranks, key=lambda r: r["timing"]["p50_ms"])
    first = ranks[0]
    others = [
        f"rank {i}: {r['syncs']} syncs {r['ops']} ops {r['collectives']} collectives"
        for i, r in enumerate(ranks)
        if (r["syncs"], r["ops"], r["collectives"])
        != (first["syncs"], first["ops"], first["collectives"])
    ]
    threads = max(1, (os.cpu_count() or 1) // SHARDED_RANKS)
    note = "; ".join([load, f"{threads} thread(s)/rank", *others])
    audited = {k: first[k] for k in ("syncs", "ops", "collectives", "sync_files")}
    timing = Timing(**slowest["timing"])
    print(f"  recsys_sharded batch {batch}x{SHARDED_RANKS}: {timing.p50_ms:.2f} ms", flush=True)
    return result("recsys_sharded", batch, SHARDED_RANKS, audited, timing, note)


# --- report -------------------------------------------------------------------------------------


def describe(r: dict) -> str:
    threads = "" if r["ranks"] > 1 else f" threads={torch.get_num_threads()}"
    # The trainer's runs check ids on the device, as on a GPU (sharded tables check in sync
    # mode); the plain loop's collections keep their default (sync).
    checks = " id_checks=async" if r["provider"] in ("recsys", "recsys_dynamic") else ""
    return (
        f"{RECIPE.relative_to(REPO_ROOT)} batch={r['batch']}x{r['ranks']} ranks={r['ranks']}"
        f"{threads} optim=adam+fused_adagrad{checks}"
    )


def write(results: list[dict], env: dict[str, str], out_dir: Path | None) -> Path:
    lines = []
    for r in results:
        timing: Timing = r["timing"]
        samples = r["batch"] * r["ranks"] / (timing.p50_ms * 1e-3)
        lines.append(
            [
                r["provider"],
                describe(r),
                r["batch"],
                r["ranks"],
                r["syncs"],
                r["ops"],
                r["collectives"],
                f"{timing.p50_ms:.4f}",
                f"{timing.p20_ms:.4f}",
                f"{timing.p80_ms:.4f}",
                timing.repeats,
                f"{samples:.0f}",
                env["device"],
                env["versions"],
                env["commit"],
                env["timestamp"],
                r["notes"],
            ]
        )
    return append_csv(TOPIC, COLUMNS, lines, out_dir)


def print_table(results: list[dict]) -> None:
    peer = {r["batch"]: r["timing"].p50_ms for r in results if r["provider"] == "torchrec_dmp"}
    lines = []
    for r in sorted(results, key=lambda r: (r["batch"], r["provider"])):
        p50 = r["timing"].p50_ms
        vs = f"{peer[r['batch']] / p50:.2f}x" if r["batch"] in peer and r["ranks"] == 1 else "-"
        batch = f"{r['batch']}x{r['ranks']}"
        lines.append(
            [r["provider"], batch, r["syncs"], r["ops"], r["collectives"], f"{p50:.2f}", vs]
        )
    header = ["provider", "batch", "syncs", "ops", "collectives", "p50 ms", "torchrec/this"]
    print(format_table(header, lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--no-sharded", action="store_true", help="skip the 2-rank case")
    args = parser.parse_args()
    device = resolve_device(args.device)
    repeats = args.repeats if args.repeats is not None else (15 if is_quick(args) else 50)
    env = environment(device)
    print(f"device: {env['device']}\nversions: {env['versions']}\ncommit: {env['commit']}")
    results = []
    sharded = not args.no_sharded and RECIPE_BATCH in args.batch_sizes
    if sharded and device.type == "cuda":
        print("recsys_sharded: not run on CUDA (it runs 2 gloo ranks on CPU)", file=sys.stderr)
        sharded = False
    if sharded:  # first: its ranks start before this process holds models and threads
        results.append(bench_sharded(RECIPE_BATCH, repeats))
    results += bench_one_process(device, args.batch_sizes, repeats)
    print_table(results)
    print(f"wrote {len(results)} rows to {write(results, env, args.out_dir)}")


if __name__ == "__main__":
    main()
