"""`torchrun -m recsys train` on 2 gloo ranks: each rank trains on its own share, only rank 0
writes, and evaluation covers the whole split across ranks."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import recsys
from recsys.build.models import build_model
from recsys.checkpoint.io import latest_checkpoint, load_checkpoint, load_model
from recsys.config import load_config
from recsys.data import build_dataset
from recsys.data.loader import BatchLoader
from recsys.train.metrics import BinaryMetrics, read_metrics
from tests.distributed.record_samples import sample_lines

PACKAGE = os.path.dirname(recsys.__file__)  # <clone>/recsys
OVERRIDES = [
    "--data.synthetic.cardinalities=[100,1000,500,20]",
    "--data.synthetic.num_train_samples=65536",
    "--data.synthetic.num_valid_samples=8192",
    "--data.synthetic.num_test_samples=20000",
    "--train.batch_size=512",
    "--train.log_every_steps=16",
    "--model.embedding_dim=8",
    "--model.dense_arch_layer_sizes=[16,8]",
    "--model.over_arch_layer_sizes=[16,1]",
    "--run.device=cpu",
    "--data.prefetch_batches=0",
]


def run_torchrun(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """torchrun in its own process group, so a hang kills the ranks too, not just the agent."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"torchrun timed out after {timeout}s:\n{stdout[-2000:]}\n{stderr[-2000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def test_two_rank_training(tmp_path):
    done = run_torchrun(
        ["--nproc-per-node=2", "-m", "recsys", "train", f"--run.dir={tmp_path}", *OVERRIDES]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("recsys: dlrm on synthetic data done") == 1  # rank 0 prints alone
    events = read_metrics(tmp_path / "metrics.jsonl")
    train = [e for e in events if e["split"] == "train"]
    # 65536 rows / (2 ranks x 512) = 64 steps, one event each 16 steps, written once.
    assert [e["step"] for e in train] == [16, 32, 48, 64]
    # the step-time breakdown counts the embedding all-to-alls, and adds up to the step
    for event in train:
        assert event["time_collectives"] > 0
        parts = sum(v for k, v in event.items() if k.startswith("time_"))
        assert abs(parts - 2 * 512 / event["samples_per_s"]) <= 0.1 * parts
    (test,) = [e for e in events if e["split"] == "test"]
    assert test["num_samples"] == 20000  # both ranks' shares
    assert 0.5 < test["auc"] <= test["oracle_auc"] + 0.02
    # The 2-rank AUC is the AUC of the whole split: one process scoring it agrees.
    config = load_config(tmp_path / "config.toml")
    dataset = build_dataset(config.data, config.run.seed)
    model = build_model(config.model, dataset.spec, torch.device("cpu"))
    state = load_checkpoint(
        tmp_path / "checkpoints" / "step_00000064", {"model": model.state_dict()}
    )
    model.load_state_dict(state["model"])
    metrics = BinaryMetrics(dataset.spec.label_names, torch.device("cpu"))
    with torch.no_grad():
        for batch in BatchLoader(dataset, "test", 4096):
            metrics.update(model(batch.dense, batch.sparse), batch.labels)
    single = metrics.compute()
    assert single["auc"] == pytest.approx(test["auc"], abs=1e-6)
    assert single["logloss"] == pytest.approx(test["logloss"], abs=1e-6)


def test_two_ranks_train_tiered_tables_and_one_process_loads_them(tmp_path):
    """Disk-tier tables under torchrun: built on the meta device, each rank holds its shards'
    rows in its own files and writes its part of the checkpoint; one process reads every part
    back and scores the test split exactly as the two ranks did."""
    done = run_torchrun(
        [
            "--nproc-per-node=2",
            "-m",
            "recsys",
            "train",
            f"--run.dir={tmp_path}",
            *OVERRIDES,
            "--model.storage.tier=disk",
            "--model.storage.min_rows=400",
            "--model.storage.cache_rows=900",
            '--distributed.constraints=["t_cat_1=row_wise"]',
            "--distributed.print_plan=true",
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cache hit rate" in done.stdout
    for rank in (0, 1):  # t_cat_1 is split by rows, t_cat_2 (500 rows) whole on one rank
        assert (tmp_path / "tables" / f"rank{rank}" / "t_cat_1.rows").is_file()
    checkpoint = tmp_path / "checkpoints" / "step_00000064"
    assert (checkpoint / "tiered.t_cat_1.part1of2.rows").is_file()
    assert (checkpoint / "tiered.t_cat_2.rows").is_file()
    events = read_metrics(tmp_path / "metrics.jsonl")
    (test,) = [e for e in events if e["split"] == "test"]
    train = [e for e in events if e["split"] == "train"]
    assert all(e["tiered/t_cat_1/hit_rate"] > 0 for e in train)
    config = load_config(tmp_path / "config.toml")
    dataset = build_dataset(config.data, config.run.seed)
    model = load_model(checkpoint)
    metrics = BinaryMetrics(dataset.spec.label_names, torch.device("cpu"))
    with torch.no_grad():
        for batch in BatchLoader(dataset, "test", 4096):
            metrics.update(model(batch.dense, batch.sparse), batch.labels)
    assert metrics.compute()["auc"] == pytest.approx(test["auc"], abs=1e-6)


def two_ranks_and_one_process(tmp_path, extra: list[str]) -> dict[str, float]:
    """The default recipe (with ``extra`` options) on 2 gloo ranks, batch 1024 each, and in
    one process with batch 2048; one pass over 1M samples each. Their test AUCs."""
    recipe = ["--config", "configs/dlrm_synthetic.toml", *extra]
    common = [
        "--data.synthetic.num_train_samples=1000000",
        "--train.eval_every_steps=0",
        "--checkpoint.save_final=false",
        "--run.device=cpu",
        "--data.prefetch_batches=0",
    ]
    done = run_torchrun(
        [
            "--nproc-per-node=2",
            "-m",
            "recsys",
            "train",
            *recipe,
            f"--run.dir={tmp_path / 'two'}",
            "--train.batch_size=1024",
            *common,
        ],
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "_WISE" in done.stdout  # the plan was printed
    single = subprocess.run(
        [
            sys.executable,
            "-m",
            "recsys",
            "train",
            *recipe,
            f"--run.dir={tmp_path / 'one'}",
            *common,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="2"),
    )
    assert single.returncode == 0, single.stderr[-3000:]
    aucs = {}
    for run in ("one", "two"):
        (test,) = [
            e for e in read_metrics(tmp_path / run / "metrics.jsonl") if e["split"] == "test"
        ]
        aucs[run] = test["auc"]
        assert test["num_samples"] == 131072
    return aucs


def test_two_ranks_reach_the_auc_of_one_process_with_the_same_global_batch(tmp_path):
    """Sharded fixed tables; the test takes ~2 minutes."""
    aucs = two_ranks_and_one_process(tmp_path, [])
    assert aucs["two"] == pytest.approx(aucs["one"], abs=0.01), aucs


@pytest.mark.slow
def test_two_ranks_with_dynamic_tables_reach_the_auc_of_one_process(tmp_path):
    """Raw ids, so every table is dynamic: KEY_WISE over the 2 ranks (~3 minutes)."""
    aucs = two_ranks_and_one_process(tmp_path, ["--data.synthetic.id_encoding=raw"])
    assert aucs["two"] == pytest.approx(aucs["one"], abs=0.01), aucs


def test_sigterm_stops_every_rank_at_one_step_with_a_checkpoint(tmp_path):
    """torchrun forwards SIGTERM to its ranks: they agree on the step, save it together and
    exit without a traceback, rank 0 saying so in one line; resume=latest on 2 ranks then
    equals an uninterrupted run. (torchrun's agent, signalled itself, prints its own
    SignalException traceback whatever its ranks do: torch's launcher, not recsys.)"""
    overrides = [*OVERRIDES, "--train.log_every_steps=1", "--train.epochs=20"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    train = ["-m", "recsys", "train", f"--run.dir={tmp_path / 'run'}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen(
        [*command, *train], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        while not (metrics.is_file() and '"train"' in metrics.read_text()):
            assert process.poll() is None, process.communicate()[1][-3000:]
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    (stop,) = [e for e in read_metrics(metrics) if e["split"] == "stop"]
    step = stop["step"]
    assert stderr.count("recsys: stopped by SIGTERM") == 1  # rank 0 for both
    assert f"recsys: stopped by SIGTERM at step {step}; checkpoint " in stderr
    # No traceback through recsys' own files (wherever the clone is, even in a folder named
    # recsys); the only traceback is the agent's own SignalException.
    assert f"{PACKAGE}{os.sep}" not in stderr
    agent = "torch.distributed.elastic.multiprocessing.api.SignalException: "
    agent_errors = [line for line in stderr.splitlines() if line.startswith(agent)]
    assert stderr.count("Traceback (most recent call last)") <= len(agent_errors) <= 1
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == f"step_{step:08d}"

    end = f"--train.max_steps={step + 2}"  # a constant rate: the end changes nothing before
    resumed = run_torchrun(["--nproc-per-node=2", *train, end, "--checkpoint.resume=latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "FutureWarning" not in resumed.stderr  # ShardedTensor's, on every load
    reference = run_torchrun(
        ["--nproc-per-node=2", "-m", "recsys", "train", f"--run.dir={tmp_path / 'reference'}",
         *overrides, end]
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr[-3000:]

    def losses(run_dir):
        events = read_metrics(run_dir / "metrics.jsonl")
        return {e["step"]: e["loss"] for e in events if e["split"] == "train"}

    assert losses(tmp_path / "run") == losses(tmp_path / "reference")


@pytest.mark.slow  # ~35 s; tests/data/test_layout.py and test_resume.py cover it in one process
def test_a_run_resumed_on_two_ranks_trains_each_sample_once(tmp_path, monkeypatch):
    """One process trains 20 of the 64 batches of 256 of an epoch of 16,384 samples and saves;
    torchrun resumes it on 2 ranks: they train the other 11,264 samples, each once (before the
    data position was global, 1 -> 2 ranks trained some samples twice and skipped others)."""
    monkeypatch.setenv("RECORD_SAMPLES", str(tmp_path))
    train = [
        "-m", "tests.distributed.record_samples", "train", f"--run.dir={tmp_path / 'run'}",
        "--data.synthetic.cardinalities=[100,1000,500,20]", "--data.synthetic.bag_sizes=[1,2,1,3]",
        "--data.synthetic.num_train_samples=16384", "--data.synthetic.num_valid_samples=256",
        "--data.synthetic.num_test_samples=256", "--train.batch_size=256",
        "--model.embedding_dim=8", "--model.dense_arch_layer_sizes=[16,8]",
        "--model.over_arch_layer_sizes=[16,1]", "--run.device=cpu", "--data.prefetch_batches=0",
        "--train.progress_bar=false", "--train.log_every_steps=64",
    ]  # fmt: skip
    one = run_torchrun(["--nproc-per-node=1", *train, "--train.max_steps=20"])
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_torchrun(["--nproc-per-node=2", *train, "--checkpoint.resume=latest"])
    assert two.returncode == 0, two.stderr[-3000:]
    ranks = [(tmp_path / f"rank{r}.txt").read_text().splitlines() for r in (0, 1)]
    assert [len(lines) for lines in ranks] == [(20 + 22) * 256, 22 * 256]
    trained = ranks[0] + ranks[1]
    assert len(set(trained)) == len(trained)  # no sample twice
    config = load_config(tmp_path / "run" / "config.toml")
    dataset = build_dataset(config.data, config.run.seed)
    split = [dataset.chunk("train", c) for c in range(dataset.num_chunks("train"))]
    assert set(trained) == {line for chunk in split for line in sample_lines(chunk)}  # all
    assert (
        "resuming epoch 0 on 2 rank(s) x batch 256 (saved on 1 x 256 after 20 batches): the "
        "11,264 samples of this epoch not yet trained, in 22 batches per rank; none dropped"
    ) in two.stdout


def test_two_rank_sequence_training(tmp_path):
    """A sequence model under torchrun: the item table sharded (the planner's plan), every
    rank's users trained and evaluated, the ranking over all of them; its checkpoint is the
    one-process model's and evaluates in one process to the same test metrics."""
    from tests.train.test_sequence_training import TINY

    run_dir = tmp_path / "seq"
    overrides = [o for o in TINY if not o.startswith("--train.batch_size")]
    done = run_torchrun(
        [
            "--nproc-per-node=2",
            "-m",
            "recsys",
            "train",
            *overrides,
            "--train.batch_size=16",
            f"--run.dir={run_dir}",
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "COLUMN_WISE" in done.stdout or "ROW_WISE" in done.stdout or "TABLE_WISE" in done.stdout
    (test,) = [e for e in read_metrics(run_dir / "metrics.jsonl") if e.get("split") == "test"]
    assert test["num_users"] == 200  # both ranks' users
    from recsys.train.evaluate import evaluate_checkpoint

    again = evaluate_checkpoint(run_dir).metrics  # in this one process
    assert again["hr@10"] == test["hr@10"] and again["num_users"] == 200
