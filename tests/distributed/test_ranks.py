"""The rank helpers in one process (the checkpoint and delta tests run them on gloo ranks)."""

from recsys.distributed import ranks


def test_one_process_is_rank_0_of_1_and_collectives_return_its_own_value():
    assert not ranks.is_distributed()
    assert (ranks.rank(), ranks.world_size()) == (0, 1)
    assert ranks.all_gather({"a": 1}) == [{"a": 1}]
    assert ranks.from_first_rank([3]) == [3]
    ranks.barrier()


def test_on_first_rank_runs_the_check_and_raises_its_value_error():
    import pytest

    calls = []
    ranks.on_first_rank(lambda: calls.append(1))
    assert calls == [1]

    def bad():
        raise ValueError("run.dir 'x' holds another run")

    with pytest.raises(ValueError, match="holds another run"):
        ranks.on_first_rank(bad)
