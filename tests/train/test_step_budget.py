"""One steady-state training step of the default recipe (``configs/dlrm_synthetic.toml``),
audited by :class:`recsys.train.step_audit.StepAudit`, against the budget recorded in
``step_audit_budget.json``: in one process (fixed tables, ``train.id_checks = "async"`` as on
a GPU: no sync at all), SASRec's step (``configs/sasrec_synthetic.toml``: no sync but its
CPU backward's), in one process with every table dynamic and every key of the step
already held (at most 2 syncs and twice the fixed step's ops), and on each of 2 gloo ranks (the
sharded step). A sync beyond the
budget fails naming its ``file:line``; ops beyond it name the files whose count grew.

After removing syncs or ops, record the lower numbers:
``RECSYS_UPDATE_AUDIT_BUDGET=1 python -m pytest tests/train/test_step_budget.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from recsys.config import load_config
from recsys.embedding.dynamic.slot_map import SlotMap
from recsys.ops.slot_map import key_arena_cpu
from recsys.train import step_audit
from recsys.train import trainer as trainer_module
from recsys.train.step_audit import AuditReport, StepAudit, audit_training
from tests.distributed.spawn import run_ranks

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "dlrm_synthetic.toml"
BUDGET_FILE = Path(__file__).with_name("step_audit_budget.json")
WARMUP = 3
BATCH = 2048


def recipe(run_dir: Path, ranks: int) -> list[str]:
    """The default recipe, with nothing but a train step in the audited step (no log event,
    evaluation or checkpoint) and the loader in its background thread."""
    return [
        f"--run.dir={run_dir}",
        "--run.device=cpu",
        "--train.progress_bar=false",
        "--train.log_every_steps=1000",
        "--train.eval_every_steps=0",
        "--checkpoint.save_final=false",
        "--data.prefetch_batches=2",
        f"--data.synthetic.num_train_samples={BATCH * ranks * (WARMUP + 8)}",
        "--data.synthetic.num_valid_samples=2048",
        "--data.synthetic.num_test_samples=2048",
    ]


def assert_nothing_logged(run_dir: Path) -> None:
    """The audited step was a plain step: no train event (they read the loss) was logged."""
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["split"] == "train"], events


def summary(report: AuditReport) -> dict[str, Any]:
    return {
        "syncs": report.syncs,
        "ops": dict(report.ops_by_file()),
        "collectives": report.collectives,
        "describe": report.describe(),
    }


def sync_key(what: str, site: str) -> str:
    return f"{site.rsplit(':', 1)[0]} {what}"


def budget_of(summaries: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """The most of each count over ``summaries`` (ranks): syncs per (file, op), ops per file,
    collectives per op."""
    budget: dict[str, Counter[str]] = {
        "syncs": Counter(),
        "ops": Counter(),
        "collectives": Counter(),
    }
    for s in summaries:
        budget["syncs"] |= Counter(sync_key(what, site) for what, site in s["syncs"])
        budget["ops"] |= Counter(s["ops"])
        budget["collectives"] |= Counter(what for what, _ in s["collectives"])
    return {kind: dict(sorted(counts.items())) for kind, counts in budget.items()}


def over_budget(measured: dict[str, Any], budget: dict[str, dict[str, int]]) -> list[str]:
    """What ``measured`` (one step's summary) has beyond ``budget``, each with where."""
    problems = []
    by_key: dict[str, list[str]] = {}
    for what, site in measured["syncs"]:
        by_key.setdefault(sync_key(what, site), []).append(site)
    for key, sites in by_key.items():
        allowed = budget["syncs"].get(key, 0)
        if len(sites) > allowed:
            what = key.rsplit(" ", 1)[1]
            problems.append(
                f"{len(sites) - allowed} new sync(s) {what} (budget {allowed} in that file): "
                f"at {', '.join(sites)}"
            )
    for path, count in measured["ops"].items():
        allowed = budget["ops"].get(path, 0)
        if count > allowed:
            problems.append(f"kernel-like ops in {path} grew: {count} (budget {allowed})")
    collectives = Counter(what for what, _ in measured["collectives"])
    for what, count in collectives.items():
        allowed = budget["collectives"].get(what, 0)
        if count > allowed:
            sites = [site for w, site in measured["collectives"] if w == what]
            problems.append(
                f"{count - allowed} new collective(s) {what} (budget {allowed}): "
                f"at {', '.join(sites)}"
            )
    return problems


def check(case: str, summaries: list[dict[str, Any]]) -> None:
    """Each summary within ``case``'s recorded budget (or, with RECSYS_UPDATE_AUDIT_BUDGET=1,
    record the measured counts as the budget)."""
    budgets = json.loads(BUDGET_FILE.read_text()) if BUDGET_FILE.exists() else {}
    if os.environ.get("RECSYS_UPDATE_AUDIT_BUDGET") == "1":
        budgets[case] = budget_of(summaries)
        BUDGET_FILE.write_text(json.dumps(budgets, indent=2, sort_keys=True) + "\n")
    assert case in budgets, f"{BUDGET_FILE} has no budget for {case!r}; record it (see above)"
    budget = budgets[case]
    for rank, measured in enumerate(summaries):
        problems = over_budget(measured, budget)
        where = f"{case} (rank {rank})" if len(summaries) > 1 else case
        assert not problems, (
            f"{where}: one steady-state step exceeds {BUDGET_FILE.name}:\n  "
            + "\n  ".join(problems)
            + f"\nthe step:\n{measured['describe']}"
        )


def test_one_process_step_within_budget(tmp_path):
    """Fixed tables, ids checked on the device as on a GPU: no sync at all."""
    config = load_config(RECIPE, [*recipe(tmp_path / "run", ranks=1), '--train.id_checks="async"'])
    report = audit_training(config, warmup=WARMUP, steps=1)
    assert_nothing_logged(tmp_path / "run")
    assert report.num_syncs == 0, "host syncs in the training step:\n" + report.describe()
    check("one_process", [summary(report)])


# The dynamic budgets are those of the key arena's compiled CPU loops (two C calls a step, not
# torch ops); without a C compiler the arena runs their tensor ops (tested in test_key_arena).
needs_loops = pytest.mark.skipif(
    not key_arena_cpu.available(), reason=f"no C compiler: {key_arena_cpu.unavailable_reason()}"
)


@needs_loops
def test_dynamic_all_hits_step_within_budget(tmp_path):
    """Every table dynamic, one batch of data over and over (every key of the audited step is
    held): no read back (the key arena's loops list no id without a slot), at most twice the
    fixed step's ops."""
    one_batch = [
        *recipe(tmp_path / "run", ranks=1),
        '--train.id_checks="async"',
        '--model.dynamic.tables=["all"]',
        f"--data.synthetic.num_train_samples={BATCH}",
        f"--train.epochs={WARMUP + 2}",
    ]
    report = audit_training(load_config(RECIPE, one_batch), warmup=WARMUP, steps=1)
    assert_nothing_logged(tmp_path / "run")
    fixed = json.loads(BUDGET_FILE.read_text())["one_process"]
    assert report.num_syncs == 0, report.describe()
    assert report.num_ops <= 2 * sum(fixed["ops"].values()), report.describe()
    check("dynamic_all_hits", [summary(report)])


SEQUENCE_RECIPE = RECIPE.with_name("sasrec_synthetic.toml")
# The CPU backward of a fused update whose optimizer FBGEMM's CPU kernels lack (Adam): it
# reads its segment bounds on the host. A GPU runs the Triton backward instead.
CPU_BACKWARD = {"recsys/ops/embedding_bag/layout.py", "recsys/ops/embedding_bag/cpu.py"}


@pytest.mark.slow
def test_sequence_step_within_budget(tmp_path):
    """SASRec's next-item step (sampled softmax, fused Adam on the item table), batches cut
    ahead in the loader's thread, ids checked on the device: no sync but the CPU backward's."""
    options = [
        f"--run.dir={tmp_path / 'run'}",
        "--run.device=cpu",
        "--train.progress_bar=false",
        "--train.log_every_steps=1000",
        "--train.eval_every_steps=0",
        "--checkpoint.save_final=false",
        "--data.prefetch_batches=2",
        "--data.synthetic_sequences.num_users=600",
        "--train.epochs=1",
        '--train.id_checks="async"',
    ]
    report = audit_training(load_config(SEQUENCE_RECIPE, options), warmup=WARMUP, steps=1)
    assert_nothing_logged(tmp_path / "run")
    assert {site.split(":")[0] for _, site in report.syncs} <= CPU_BACKWARD, report.describe()
    check("sequence_one_process", [summary(report)])


def audit_placing_step(tmp_path, monkeypatch, options: list[str]) -> tuple[AuditReport, list]:
    """Audit step 41 of a fresh run, every table dynamic with ``options``; returns the report
    and the (inserts, evictions, overflow) the key arena counted for each table in that step."""
    placed, at_audit = [], []
    count_placed = SlotMap.count_placed
    monkeypatch.setattr(
        SlotMap,
        "count_placed",
        lambda m, *counts: (placed.append(counts), count_placed(m, *counts)),
    )

    @contextlib.contextmanager
    def audit(device):
        at_audit.append(len(placed))
        with StepAudit(device) as report:
            yield report

    monkeypatch.setattr(step_audit, "StepAudit", audit)
    warmup = 40
    fresh = [
        *recipe(tmp_path / "run", ranks=1),
        '--train.id_checks="async"',
        '--model.dynamic.tables=["all"]',
        f"--data.synthetic.num_train_samples={BATCH * (warmup + 4)}",
        *options,
    ]
    report = audit_training(load_config(RECIPE, fresh), warmup=warmup, steps=1)
    assert_nothing_logged(tmp_path / "run")
    # the ids without a valid hint, their misses, what was placed: one read more than hits
    assert report.num_syncs <= 3, report.describe()
    assert {site.split(":")[0] for _, site in report.syncs} <= {
        "recsys/embedding/dynamic/key_arena.py"
    }
    return report, placed[at_audit[0] :]


@needs_loops
def test_dynamic_new_keys_step_within_budget(tmp_path, monkeypatch):
    """Every table dynamic, fresh samples: once the tables have grown, a step whose batch
    brings new keys places them in the key arena, with one sync (what was placed) where a step
    of hits has none."""
    report, placed = audit_placing_step(tmp_path, monkeypatch, [])
    assert sum(counts[0] for counts in placed), "the audited step placed no new key"
    check("dynamic_new_keys", [summary(report)])


@needs_loops
def test_dynamic_at_cap_step_within_budget(tmp_path, monkeypatch):
    """Every table dynamic and at its cap (4096 rows from the start): a step whose batch brings
    new keys evicts in the key arena, with no more syncs than a step that only places."""
    cap = ["--model.dynamic.initial_capacity=4096", "--model.dynamic.max_capacity=4096"]
    report, placed = audit_placing_step(tmp_path, monkeypatch, cap)
    assert sum(counts[1] for counts in placed), "the audited step evicted no key"
    check("dynamic_at_cap", [summary(report)])


def _audit_rank(rank: int, world: int, out: str) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    trainer_module.shutdown_distributed = lambda: None  # the process group is run_ranks's
    torch.set_num_threads(1)
    config = load_config(RECIPE, recipe(Path(out, "run"), ranks=world))
    report = audit_training(config, warmup=WARMUP, steps=1)
    if rank == 0:
        assert_nothing_logged(Path(out, "run"))
    Path(out, f"rank{rank}.json").write_text(json.dumps(summary(report)))


def test_sharded_step_within_budget(tmp_path):
    run_ranks(2, _audit_rank, str(tmp_path))
    summaries = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    assert all(s["collectives"] for s in summaries), "a sharded step exchanges embeddings"
    check("sharded_2_ranks", summaries)


def test_over_budget_names_new_syncs_and_grown_files():
    budget = {
        "syncs": {"recsys/ops/a.py nonzero": 1},
        "ops": {"recsys/ops/a.py": 5, "recsys/train/step.py": 10},
        "collectives": {"alltoall_base_": 2},
    }
    within = {
        "syncs": [("nonzero", "recsys/ops/a.py:7")],
        "ops": {"recsys/ops/a.py": 5, "recsys/train/step.py": 9},
        "collectives": [("alltoall_base_", "recsys/distributed/comm.py:3")],
    }
    assert over_budget(within, budget) == []
    beyond = {
        "syncs": [
            ("nonzero", "recsys/ops/a.py:7"),
            ("nonzero", "recsys/ops/a.py:9"),
            ("_local_scalar_dense", "recsys/train/step.py:63"),
        ],
        "ops": {"recsys/ops/a.py": 6, "recsys/train/step.py": 10, "recsys/ops/b.py": 1},
        "collectives": [("alltoall_base_", "x.py:1")] * 3,
    }
    problems = "\n".join(over_budget(beyond, budget))
    assert "1 new sync(s) nonzero (budget 1 in that file): at recsys/ops/a.py:7, " in problems
    assert "recsys/ops/a.py:9" in problems
    assert (
        "1 new sync(s) _local_scalar_dense (budget 0 in that file): at recsys/train/step.py:63"
        in problems
    )
    assert "ops in recsys/ops/a.py grew: 6 (budget 5)" in problems
    assert "ops in recsys/ops/b.py grew: 1 (budget 0)" in problems
    assert "recsys/train/step.py grew" not in problems
    assert "1 new collective(s) alltoall_base_ (budget 2)" in problems
