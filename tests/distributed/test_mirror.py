"""The mirror process group: one process standing for every rank of a job (each peer does what
this rank does), and a rank's step timed in it for ``recsys plan``."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from recsys.config import load_config
from recsys.distributed.mirror import mirrored
from recsys.train.rank_timing import rank_step_seconds, slowest_pieces
from recsys.train.stop import StopSignals


def test_collectives_hand_every_peer_this_ranks_own_part():
    before = {key: os.environ.get(key) for key in ("WORLD_SIZE", "RANK")}
    with mirrored(world_size=4, rank=1):
        assert (dist.get_world_size(), dist.get_rank()) == (4, 1)
        assert (os.environ["WORLD_SIZE"], os.environ["RANK"]) == ("4", "1")
        # all-to-all: rank 1 sends 1, 2, 3, 1 rows to ranks 0..3 and keeps [20, 21] itself;
        # a peer's block of the same size is that, one of another size zeros
        send = torch.tensor([10, 20, 21, 30, 31, 32, 40])
        recv = torch.full((7,), -1)
        dist.all_to_all_single(recv, send, [2, 2, 1, 2], [1, 2, 3, 1])
        assert recv.tolist() == [20, 21, 20, 21, 0, 20, 21]
        even = torch.arange(8.0)
        out = torch.empty(8)
        dist.all_to_all_single(out, even)  # even splits: block 1 is [2, 3]
        assert out.tolist() == [2.0, 3.0] * 4
        gathered = torch.empty(3 * 4)
        dist.all_gather_single(gathered, torch.tensor([1.0, 2.0, 3.0]))
        assert gathered.tolist() == [1.0, 2.0, 3.0] * 4
        listed = [torch.empty(2) for _ in range(4)]
        dist.all_gather(listed, torch.tensor([5.0, 6.0]))
        assert all(t.tolist() == [5.0, 6.0] for t in listed)
        total = torch.tensor([7.0])
        dist.all_reduce(total)  # the peers' parts are this one's: a sum is left to its reader
        dist.broadcast(total, src=0)
        assert total.tolist() == [7.0]
        dist.barrier()
        group = dist.new_group([0, 1])  # sub-groups of the same kind
        assert dist.get_world_size(group) == 2
        with StopSignals(world_size=4) as signals:  # its flags' group: the mirror's own
            assert not signals.requested() and not signals.requested()
    assert not dist.is_initialized()
    assert {key: os.environ.get(key) for key in before} == before


def test_a_mirrored_world_is_not_started_inside_another_or_for_a_rank_outside_it():
    with pytest.raises(ValueError, match="rank 4 of 4 ranks"), mirrored(world_size=4, rank=4):
        pass
    already = pytest.raises(RuntimeError, match="one is already running")
    with mirrored(world_size=2), already, mirrored(world_size=2):
        pass
    assert not dist.is_initialized()


def test_a_ranks_step_is_timed_with_its_peers_mirrored():
    config = load_config(
        None,
        [
            "--data.synthetic.num_train_samples=40000",
            "--data.synthetic.cardinalities=[100,1000,500,4]",
            "--data.synthetic.bag_sizes=[1,3,2,1]",
            "--train.batch_size=256",
        ],
    )
    flat, how = rank_step_seconds(config, world_size=4, steps=12)
    assert 0 < flat < 1 and "ranks 0-3 of 4 timed on this host with their peers mirrored" in how
    assert how.startswith(f"{1e3 * flat:,.2f} ms a step less its collectives")
    assert "(12 steps each" in how
    one, how = rank_step_seconds(config, world_size=4, steps=12, ranks=[2])
    assert one > 0 and "rank 2 of 4 timed on this host with its peers mirrored" in how
    two_d, _ = rank_step_seconds(config, world_size=4, replicas=2, steps=12)
    assert 0 < two_d < 1
    assert not dist.is_initialized()
    # a rank whose tables would not fit beside this host's other work is not timed
    untimed, why = rank_step_seconds(config, world_size=4, rank_bytes=2**60)
    assert untimed == 0 and why.startswith("not timed (a rank's tables and state")
    # nor one a run could not make: the plan is printed all the same, with the reason
    untimed, why = rank_step_seconds(config, world_size=64, steps=12)
    assert untimed == 0 and why.startswith("not timed (the train split has")
    assert not dist.is_initialized()


def test_each_piece_of_a_step_lasts_as_long_as_the_slowest_ranks():
    a = np.array
    # two ranks, three steps of three pieces; rank 1's third step has a fourth piece (a step
    # that logged, say): that step is left out for both
    runs = [
        [a([1.0, 4.0, 1.0]), a([2.0, 2.0, 2.0]), a([1.0, 1.0, 1.0])],
        [a([3.0, 1.0, 1.0]), a([2.0, 5.0, 1.0]), a([9.0, 9.0, 9.0, 9.0])],
    ]
    step, alone, kept, shape = slowest_pieces(runs)
    assert (kept, shape) == (2, 3)
    # step 0: 3 + 4 + 1, step 1: 2 + 5 + 2; a rank's step alone: 6, 5, 6, 8
    assert step == pytest.approx((8 + 9) / 2) and alone == pytest.approx(25 / 4)
    # the same step of each rank is paired: a slow step on both counts once
    same = [[a([1.0]), a([10.0])], [a([1.0]), a([10.0])]]
    assert slowest_pieces(same)[0] == pytest.approx(5.5)
