"""Elastic restarts: one rank of a 2-rank ``torchrun --max-restarts=1`` job is killed mid-run; the
agent restarts the job with the same command, which resumes from the newest checkpoint
(``checkpoint.resume = "latest"``) and ends exactly where an uninterrupted run ends: same final
step, every step logged once, and bitwise the same losses and weights (resume is exact on CPU).
The same for a 4-rank 2D job (``distributed.sparse_replicas = 2``, replicas synced every 4
steps; a checkpoint syncs the replicas first, so every replica saves the same shards), equal to
the uninterrupted run up to float rounding: on 3+ ranks DDP's gradient sums after a resume
differ in the last bit (see the test).

Linux only: the worker to kill is found through /proc.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from recsys.checkpoint.io import latest_checkpoint, load_model
from recsys.train.metrics import read_metrics

EVERY_STEPS = 8
TOTAL_STEPS = 128  # 65536 rows / (2 ranks x 256); 4 ranks: 64
OVERRIDES = [
    "--data.synthetic.cardinalities=[100,1000,500,20]",
    "--data.synthetic.num_train_samples=65536",
    "--data.synthetic.num_valid_samples=1024",
    "--data.synthetic.num_test_samples=2048",
    "--train.batch_size=256",
    "--train.log_every_steps=1",
    "--train.progress_bar=false",
    "--run.device=cpu",
    "--data.prefetch_batches=0",
    "--checkpoint.resume=latest",
    f"--checkpoint.every_steps={EVERY_STEPS}",
]
TIMEOUT_S = 180
LAYOUTS = {  # name -> (ranks, extra overrides, steps, seconds allowed)
    "flat": (2, [], TOTAL_STEPS, TIMEOUT_S),
    "2d": (4, ["--distributed.sparse_replicas=2", "--distributed.sync_every=4"], 64, 600),
}

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def launch(run_dir: Path, max_restarts: int, layout: str = "flat") -> subprocess.Popen:
    """``torchrun -m recsys train`` of ``layout`` in its own process group (a hang kills the
    ranks too), its output in ``<run_dir>.out`` / ``.err`` (files, not pipes: nobody reads while
    it runs)."""
    ranks, extra, _, _ = LAYOUTS[layout]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        f"--max-restarts={max_restarts}",
        "-m",
        "recsys",
        "train",
        f"--run.dir={run_dir}",
        *OVERRIDES,
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(f"{run_dir}.out", "w") as out, open(f"{run_dir}.err", "w") as err:
        return subprocess.Popen(
            command, stdout=out, stderr=err, text=True, env=env, start_new_session=True
        )


def wait(job: subprocess.Popen, run_dir: Path, deadline: float) -> tuple[str, str]:
    """Wait for ``job`` to exit; return its stdout and stderr."""
    try:
        job.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        pytest.fail(f"torchrun timed out:\n{output(run_dir)[1][-3000:]}")
    return output(run_dir)


def output(run_dir: Path) -> tuple[str, str]:
    return Path(f"{run_dir}.out").read_text(), Path(f"{run_dir}.err").read_text()


def errors(stderr: str) -> str:
    """The error lines of every attempt (torchrun's own summary names only the last one)."""
    lines = [line for line in stderr.splitlines() if "Error" in line]
    return "\n".join(lines[-8:]) + "\n" + stderr[-1500:]


def worker(agent: int, rank: int) -> tuple[int, dict[str, str]]:
    """The pid and environment of the torchrun agent's worker process of ``rank``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            environ = (entry / "environ").read_bytes()
        except OSError:  # exited meanwhile, or not ours
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid ..."
        env = dict(v.split("=", 1) for v in environ.decode().split("\0") if "=" in v)
        if parent == agent and env.get("RANK") == str(rank):
            return int(entry.name), env
    raise AssertionError(f"torchrun agent {agent} has no worker of rank {rank}")


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step_"))


def final_state(run_dir: Path) -> tuple[Path, dict[str, torch.Tensor], list[dict]]:
    """The newest checkpoint, its model weights, and the run's metrics events."""
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None, f"{run_dir} has no checkpoint"
    return checkpoint, load_model(checkpoint).state_dict(), read_metrics(run_dir / "metrics.jsonl")


@pytest.mark.parametrize(
    "layout",
    ["flat", pytest.param("2d", marks=pytest.mark.slow)],  # 2d: 4 ranks, about 3 minutes
)
def test_killed_rank_restarts_and_resumes(tmp_path, layout):
    _, _, total_steps, timeout_s = LAYOUTS[layout]
    deadline = time.monotonic() + timeout_s
    killed_dir, reference_dir = tmp_path / "killed", tmp_path / "reference"
    job = launch(killed_dir, max_restarts=1, layout=layout)
    try:
        # Any committed checkpoint will do (a poll that oversleeps may find a later one).
        while latest_checkpoint(killed_dir / "checkpoints") is None:
            if job.poll() is not None:
                pytest.fail(f"torchrun exited before a checkpoint:\n{output(killed_dir)}")
            assert time.monotonic() < deadline, f"no checkpoint in {timeout_s} s"
            time.sleep(0.01)
        pid, env = worker(job.pid, rank=1)
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        # Frozen first: without rank 1 no step's collectives (nor a checkpoint's barriers) can
        # complete, so what is on disk now shows the job is mid-run when killed.
        os.kill(pid, signal.SIGSTOP)
        newest_at_kill = latest_checkpoint(killed_dir / "checkpoints")
        os.kill(pid, signal.SIGKILL)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        raise
    stdout, stderr = wait(job, killed_dir, deadline)
    assert job.returncode == 0, errors(stderr)
    assert newest_at_kill is not None and step_of(newest_at_kill) < total_steps

    # The same config, never interrupted; only the run directory differs.
    reference = launch(reference_dir, max_restarts=0, layout=layout)
    ref_stdout, ref_stderr = wait(reference, reference_dir, deadline)
    assert reference.returncode == 0, errors(ref_stderr)
    assert "resumed from" not in ref_stdout

    checkpoint, weights, events = final_state(killed_dir)
    ref_checkpoint, ref_weights, ref_events = final_state(reference_dir)

    # The job restarted once, from a checkpoint taken before the end, and redid the rest.
    resumes = [e for e in events if e["split"] == "resume"]
    assert len(resumes) == 1, resumes
    resume = resumes[0]
    assert step_of(newest_at_kill) <= resume["step"] < total_steps
    assert resume["step"] % EVERY_STEPS == 0
    assert Path(resume["checkpoint"]).name == f"step_{resume['step']:08d}"
    assert stdout.count("resumed from") == 1  # rank 0 of the second attempt
    # only the second attempt finished
    assert stdout.count("recsys: dlrm on synthetic data done") == 1

    # It ended where the uninterrupted run ends, every step trained and logged exactly once.
    assert checkpoint.name == ref_checkpoint.name == f"step_{total_steps:08d}"
    assert (killed_dir / "checkpoints" / "latest").resolve() == checkpoint.resolve()
    assert not list((killed_dir / "checkpoints").glob(".tmp-*"))  # a cut-short save: cleaned
    train = [e for e in events if e["split"] == "train"]
    ref_train = [e for e in ref_events if e["split"] == "train"]
    assert [e["step"] for e in train] == list(range(1, total_steps + 1))
    assert [e["step"] for e in ref_train] == list(range(1, total_steps + 1))

    losses = [e["loss"] for e in train]
    ref_losses = [e["loss"] for e in ref_train]
    (test,) = [e for e in events if e["split"] == "test"]
    (ref_test,) = [e for e in ref_events if e["split"] == "test"]
    assert weights.keys() == ref_weights.keys()
    # Exact resume, flat on 2 ranks and 2D on 4: the same loss at every step and the same final
    # weights, bit for bit (on 3+ ranks because the dense part fits DDP's first bucket, whose
    # layout DDP then keeps: recsys.distributed.parallel).
    first_differences = [
        (step, a, b)
        for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True), 1)
        if a != b
    ][:5]
    assert not first_differences, f"(step, loss, uninterrupted loss): {first_differences}"
    differ = [k for k in weights if not torch.equal(weights[k], ref_weights[k])]
    assert not differ, f"weights differ from the uninterrupted run's: {differ}"
    assert (test["auc"], test["logloss"]) == (ref_test["auc"], ref_test["logloss"])
