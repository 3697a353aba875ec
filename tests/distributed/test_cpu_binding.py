"""``distributed.cpu_binding``: each CPU rank of a node on its own block of cores, the
transport's threads with it, and the same losses bound or not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from recsys.distributed.cpu_binding import bind_local_rank, local_cores
from recsys.train.metrics import read_metrics
from tests.distributed.test_torchrun import run_torchrun

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def test_each_local_rank_gets_its_own_contiguous_block_of_the_cores():
    assert local_cores(0, 2, [0, 1, 2, 3]) == [0, 1]
    assert local_cores(1, 2, [3, 1, 0, 2]) == [2, 3]  # in order, whatever order they come in
    assert local_cores(2, 3, [4, 5, 6, 7, 8, 9, 10]) == [8, 9]  # the remainder is left out
    assert local_cores(1, 4, [0, 1]) == []  # more ranks than cores: nothing to bind
    with pytest.raises(ValueError, match="local rank 2 of 2"):
        local_cores(2, 2, [0, 1])


def test_off_cuda_one_rank_and_a_bad_mode_bind_nothing(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    before = os.sched_getaffinity(0)
    assert bind_local_rank("off", torch.device("cpu")) == []
    assert bind_local_rank("auto", torch.device("cuda", 0)) == []
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert bind_local_rank("auto", torch.device("cpu")) == []
    with pytest.raises(ValueError, match="distributed.cpu_binding = 'on'; expected one of"):
        bind_local_rank("on", torch.device("cpu"))
    assert os.sched_getaffinity(0) == before


@pytest.mark.skipif(len(CORES) < 2, reason="binding needs at least 2 cores")
def test_auto_binds_the_process_and_threads_it_starts_later():
    """A process standing for the last local rank of as many ranks as there are cores: its
    threads, the one running before and one started after, run on that core alone."""
    script = textwrap.dedent(
        """
        import json, os, threading, torch
        from recsys.distributed.cpu_binding import bind_local_rank
        seen, go = {}, threading.Event()
        def look(name):
            go.wait()
            seen[name] = sorted(os.sched_getaffinity(0))
        early = threading.Thread(target=look, args=("early",))
        early.start()
        bound = bind_local_rank("auto", torch.device("cpu"))
        go.set()
        early.join()
        later = threading.Thread(target=look, args=("later",))
        later.start()
        later.join()
        print(json.dumps([bound, sorted(os.sched_getaffinity(0)), seen["early"], seen["later"]]))
        """
    )
    env = dict(os.environ, LOCAL_RANK=str(len(CORES) - 1), LOCAL_WORLD_SIZE=str(len(CORES)))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == [[CORES[-1]]] * 4


@pytest.mark.skipif(len(CORES) < 2, reason="binding needs at least 2 cores")
def test_two_ranks_train_the_same_losses_bound_or_not(tmp_path):
    losses = {}
    for setting in ("auto", "off"):
        run_dir = tmp_path / setting
        done = run_torchrun(
            [
                "--nproc-per-node=2",
                "-m",
                "recsys",
                "train",
                f"--run.dir={run_dir}",
                "--data.synthetic.num_train_samples=32768",
                "--train.batch_size=512",
                "--train.log_every_steps=8",
                "--train.eval_every_steps=0",
                "--checkpoint.save_final=false",
                "--run.device=cpu",
                "--run.tensorboard=false",
                f"--distributed.cpu_binding={setting}",
            ]
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("on its own 1 CPU core" in done.stdout) == (setting == "auto" and len(CORES) == 2)
        train = [e for e in read_metrics(run_dir / "metrics.jsonl") if e["split"] == "train"]
        losses[setting] = [e["loss"] for e in train]
    assert len(losses["auto"]) == 4
    assert losses["auto"] == losses["off"]  # bitwise: where threads run changes no arithmetic
