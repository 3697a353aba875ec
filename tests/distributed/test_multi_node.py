"""Two torchrun agents, as two nodes would run them (``--nnodes=2 --nproc-per-node=2``, c10d
rendezvous on this machine), train the default recipe with bitwise the losses of one agent with 4
ranks; and when a worker of one node dies mid-run, both agents restart their workers
(``--max-restarts``: the failed node's agent for the failure, the other for the new rendezvous
round) and the job resumes from its newest checkpoint to the uninterrupted run's end, with
bitwise the uninterrupted run's losses.

Both launches set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as the README's multi-node launch
does: the restarted attempt then meets in a fresh store.

Linux only: the agents' workers are found through /proc.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recsys.checkpoint.io import latest_checkpoint
from recsys.train.metrics import read_metrics

from .test_elastic import errors, worker

STEPS = 160
EVERY_STEPS = 8
OVERRIDES = [
    "--config=configs/dlrm_synthetic.toml",  # the default recipe (make train)
    f"--train.max_steps={STEPS}",
    "--train.log_every_steps=1",
    "--train.progress_bar=false",
    "--train.eval_every_steps=0",
    "--data.synthetic.num_test_samples=4096",
    "--data.loader_workers=0",
    "--data.prefetch_batches=0",
    "--run.device=cpu",
    "--run.tensorboard=false",
    "--checkpoint.resume=latest",
    f"--checkpoint.every_steps={EVERY_STEPS}",
]
TIMEOUT_S = 420
REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(run_dir: Path, name: str, rendezvous: list[str], max_restarts: int = 0):
    """One torchrun agent running ``recsys train`` in its own process group, its output in
    ``<run_dir>.<name>.out`` / ``.err``."""
    command = [
        *(sys.executable, "-m", "torch.distributed.run", *rendezvous),
        f"--max-restarts={max_restarts}",
        *("-m", "recsys", "train", f"--run.dir={run_dir}", *OVERRIDES),
    ]
    # A fresh store per rendezvous round (the README's multi-node launch sets it too): agents
    # count restarts differently (a node restarts for the failure, the other for the new round)
    # and the shared store would hold the killed attempt's addresses under the same scope.
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    with open(f"{run_dir}.{name}.out", "w") as out, open(f"{run_dir}.{name}.err", "w") as err:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=err,
            text=True,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )


def first_agent_hosts_the_store(port: int, deadline: float) -> None:
    """Wait until the first agent listens on the rendezvous port: it hosts the c10d store, so
    the second agent, started next, is a client that can die without taking the store along."""
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert time.monotonic() < deadline, f"no rendezvous store on port {port}"
        time.sleep(0.1)


def two_nodes(port: int) -> list[str]:
    return [
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=job{port}",
    ]


def finish(jobs: dict[str, subprocess.Popen], run_dir: Path, deadline: float) -> None:
    """Wait for every agent; fail with their errors if one fails or time runs out."""
    try:
        for name, job in jobs.items():
            job.wait(timeout=max(deadline - time.monotonic(), 1))
            err = Path(f"{run_dir}.{name}.err").read_text()
            assert job.returncode == 0, f"agent {name} exited {job.returncode}:\n{errors(err)}"
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun agents timed out in {run_dir}")
    finally:
        kill_all(jobs)


def kill_all(jobs: dict[str, subprocess.Popen]) -> None:
    """SIGKILL the agents and their workers (each worker in a session of its own)."""
    pids = [worker(jobs[name].pid, rank)[0] for name, rank in _ranks(jobs)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for job in jobs.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def _ranks(jobs: dict[str, subprocess.Popen]) -> list[tuple[str, int]]:
    """(agent, rank) of every worker the agents have now."""
    found = []
    for name, job in jobs.items():
        for rank in range(4):
            with contextlib.suppress(AssertionError):
                worker(job.pid, rank)
                found.append((name, rank))
    return found


def losses(run_dir: Path) -> list[float]:
    events = read_metrics(run_dir / "metrics.jsonl")
    train = [e for e in events if e["split"] == "train"]
    assert [e["step"] for e in train] == list(range(1, STEPS + 1))
    return [e["loss"] for e in train]


@pytest.fixture(scope="module")
def one_agent(tmp_path_factory) -> list[float]:
    """The uninterrupted run: one agent with 4 ranks."""
    run_dir = tmp_path_factory.mktemp("one_agent") / "run"
    job = agent(run_dir, "a", ["--standalone", "--nproc-per-node=4"])
    finish({"a": job}, run_dir, time.monotonic() + TIMEOUT_S)
    return losses(run_dir)


def test_two_agents_train_as_one_agent_with_as_many_ranks(one_agent, tmp_path):
    run_dir, port = tmp_path / "run", _free_port()
    rendezvous = two_nodes(port)
    jobs = {"a": agent(run_dir, "a", rendezvous)}
    first_agent_hosts_the_store(port, time.monotonic() + TIMEOUT_S)
    jobs["b"] = agent(run_dir, "b", rendezvous)
    finish(jobs, run_dir, time.monotonic() + TIMEOUT_S)
    assert losses(run_dir) == one_agent
    assert "resumed from" not in Path(f"{run_dir}.a.out").read_text()


def test_a_killed_worker_restarts_both_nodes_and_resumes_from_the_checkpoint(one_agent, tmp_path):
    deadline = time.monotonic() + TIMEOUT_S
    run_dir, port = tmp_path / "run", _free_port()
    rendezvous = two_nodes(port)
    jobs = {"a": agent(run_dir, "a", rendezvous, max_restarts=1)}
    first_agent_hosts_the_store(port, deadline)
    jobs["b"] = agent(run_dir, "b", rendezvous, max_restarts=1)
    try:
        while latest_checkpoint(run_dir / "checkpoints") is None:
            assert all(j.poll() is None for j in jobs.values()), "an agent exited early"
            assert time.monotonic() < deadline, f"no checkpoint in {TIMEOUT_S} s"
            time.sleep(0.01)
        ranks = {rank: worker(jobs[name].pid, rank)[1] for name, rank in _ranks(jobs)}
        assert sorted(ranks) == [0, 1, 2, 3]
        assert {
            (env["LOCAL_WORLD_SIZE"], env["TORCHELASTIC_RESTART_COUNT"]) for env in ranks.values()
        } == {("2", "0")}
        # A worker of node b dies, frozen first: without it no step (nor checkpoint) can
        # complete, so the newest checkpoint now is the one the job must resume from.
        (rank,) = [r for n, r in _ranks(jobs) if n == "b"][:1]
        pid = worker(jobs["b"].pid, rank)[0]
        os.kill(pid, signal.SIGSTOP)
        killed_at = latest_checkpoint(run_dir / "checkpoints")
        os.kill(pid, signal.SIGKILL)
        assert int(killed_at.name.removeprefix("step_")) < STEPS
    except BaseException:
        kill_all(jobs)
        raise
    finish(jobs, run_dir, deadline)
    events = read_metrics(run_dir / "metrics.jsonl")
    resumes = [e for e in events if e["split"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] >= int(killed_at.name.removeprefix("step_"))
    # Bitwise: the dense part fits DDP's first bucket, whose layout never changes, so the first
    # resumed step all-reduces as the uninterrupted run did (recsys.distributed.parallel).
    assert losses(run_dir) == one_agent
