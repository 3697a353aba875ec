"""The sharding planner: plans are valid, fit memory, honour constraints, and read well."""

import re

import pytest
from torchrec import DataType, EmbeddingBagConfig

from recsys.distributed.planner import (
    Shard,
    ShardingPlan,
    ShardingType,
    TableConstraint,
    TableSharding,
    check_plan,
    check_table_sharding,
    column_wise,
    data_parallel,
    parse_constraints,
    plan_sharding,
    row_block,
    row_wise,
    table_wise,
)

ROWWISE_ADAGRAD = {"sum": "row"}  # recsys.embedding.optim.RowWiseAdagrad.states
ADAM = {"exp_avg": "element", "exp_avg_sq": "element"}
ELEMENT_BYTES = {DataType.FP32: 4, DataType.FP16: 2, DataType.BF16: 2}


def table(name, rows, dim, data_type=DataType.FP32, features=None):
    return EmbeddingBagConfig(
        name=name,
        num_embeddings=rows,
        embedding_dim=dim,
        feature_names=features or [f"f_{name}"],
        data_type=data_type,
    )


def shard_bytes(config, shard, states):
    """Bytes of one shard, computed independently of the planner."""
    weights = shard.num_rows * shard.num_cols
    state = sum(shard.num_rows if kind == "row" else weights for kind in states.values())
    return weights * ELEMENT_BYTES[config.data_type] + 4 * state


def rank_bytes(plan, collections, states):
    used = [0] * plan.world_size
    for path, configs in collections.items():
        for config in configs:
            for shard in plan[path][config.name].shards:
                used[shard.rank] += shard_bytes(config, shard, states)
    return used


def kinds(plan, path=""):
    return {name: sharding.sharding_type for name, sharding in plan[path].items()}


MIXED = {
    "sparse.ebc": [
        table("t_huge", 2_000_000, 64),
        table("t_wide", 100_000, 128, DataType.FP16),
        table("t_mid", 300_000, 32, DataType.BF16, features=["f_a", "f_b"]),
        table("t_small", 200, 16),
    ],
    "other.ebc": [table("t_small", 50, 8), table("t_user", 500_000, 48)],
}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(
    ("budget", "states"), [(0, {}), (2**30, ROWWISE_ADAGRAD), (3 * 2**29, ADAM)]
)
def test_plans_are_valid_and_fit_memory(world_size, budget, states):
    if budget and world_size == 1:
        budget *= 4  # one rank must hold everything
    plan = plan_sharding(
        MIXED, world_size, memory_per_rank=budget, optimizer_states=states, batch_size=512
    )
    check_plan(plan, MIXED, world_size)
    assert plan.memory_per_rank == budget
    used = rank_bytes(plan, MIXED, states)
    if budget:
        assert max(used) <= budget, used
    described = [sum(fp.shard_bytes) for c in plan.footprints.values() for fp in c.values()]
    assert sum(described) == sum(used)
    assert len(plan.rank_costs) == world_size


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_tight_memory_is_respected(world_size):
    # 15% above an even split of all tables' bytes over the ranks (Adagrad: per-element state,
    # so COLUMN_WISE is allowed too).
    states = {"sum": "element"}
    configs = [config for configs in MIXED.values() for config in configs]
    total = sum(
        shard_bytes(c, Shard(0, 0, c.num_embeddings, 0, c.embedding_dim), states) for c in configs
    )
    budget = int(1.15 * total / world_size)
    plan = plan_sharding(MIXED, world_size, memory_per_rank=budget, optimizer_states=states)
    check_plan(plan, MIXED, world_size)
    used = rank_bytes(plan, MIXED, states)
    assert max(used) <= budget, used


def test_world_of_one_is_table_wise_on_rank_0():
    plan = plan_sharding(MIXED, 1)
    for shardings in plan.collections.values():
        for sharding in shardings.values():
            assert sharding.sharding_type == ShardingType.TABLE_WISE
            assert sharding.ranks == [0]


def test_table_that_only_fits_row_wise_is_row_wise():
    # 1000 x 8 fp32 + one fp32 per row: 36 bytes a row, 36000 in all. ROW_WISE over 4 ranks
    # needs 250 * 36 = 9000 a rank; two column pieces need 1000 * (4 * 4 + 4) = 20000.
    tables = {"": [table("t", 1000, 8)]}
    plan = plan_sharding(tables, 4, memory_per_rank=10_000, optimizer_states=ROWWISE_ADAGRAD)
    check_plan(plan, tables, 4)
    assert plan[""]["t"] == row_wise(1000, 8, 4)
    assert max(rank_bytes(plan, tables, ROWWISE_ADAGRAD)) == 9000


def test_second_table_fits_in_what_the_first_leaves():
    # With one fp32 of state per row, "big" (40000 x 8) needs 360000 bytes a rank row-wise and
    # more any other way; "next" (8000 x 8) then has 73000 bytes a rank left: enough row-wise
    # (72000), not in two column pieces (160000) or whole (288000).
    tables = {"": [table("big", 40_000, 8), table("next", 8_000, 8)]}
    budget = 360_000 + 72_000 + 1000
    plan = plan_sharding(tables, 4, memory_per_rank=budget, optimizer_states=ROWWISE_ADAGRAD)
    check_plan(plan, tables, 4)
    assert max(rank_bytes(plan, tables, ROWWISE_ADAGRAD)) == budget - 1000
    assert plan[""]["big"] == row_wise(40_000, 8, 4)
    assert plan[""]["next"] == row_wise(8_000, 8, 4)


def test_not_fitting_names_the_table_and_the_missing_bytes():
    # ROW_WISE comes closest: 9000 bytes a rank against 8000 -> 1000 bytes missing.
    tables = {"sparse": [table("t_small", 10, 8), table("t_big", 1000, 8)]}
    with pytest.raises(ValueError) as error:
        plan_sharding(tables, 4, memory_per_rank=8_000, optimizer_states=ROWWISE_ADAGRAD)
    message = str(error.value)
    assert "'sparse:t_big'" in message
    assert "(1000 bytes)" in message
    assert "ROW_WISE" in message
    assert "memory_per_rank" in message


def test_not_fitting_counts_what_is_already_placed():
    # "first" (64000 bytes) takes 16000 of every rank's 20000, so "second" (the same) lacks
    # 12000 on each.
    tables = {"": [table("first", 4000, 4), table("second", 4000, 4)]}
    with pytest.raises(ValueError, match=r"'second'.*\(12000 bytes\)"):
        plan_sharding(tables, 4, memory_per_rank=20_000)


def test_constraints_restrict_type_and_ranks():
    constraints = parse_constraints(
        [
            "t_huge=row_wise",
            "t_wide=column_wise@3,1",
            "sparse.ebc:t_small=table_wise@2",
            "t_user=TABLE_WISE@0,3",
            "other.ebc:t_small=data_parallel",
        ]
    )
    plan = plan_sharding(MIXED, 4, constraints=constraints)
    check_plan(plan, MIXED, 4)
    assert plan["sparse.ebc"]["t_huge"] == row_wise(2_000_000, 64, 4)
    wide = plan["sparse.ebc"]["t_wide"]
    assert wide.sharding_type == ShardingType.COLUMN_WISE
    assert wide.ranks == [3, 1]
    assert [s.num_cols for s in wide.shards] == [64, 64]
    assert plan["sparse.ebc"]["t_small"] == table_wise(200, 16, 2)
    assert plan["other.ebc"]["t_user"].ranks in ([0], [3])
    assert plan["other.ebc"]["t_small"] == data_parallel(50, 8, 4)


def test_bare_table_name_constrains_every_collection():
    plan = plan_sharding(MIXED, 4, constraints=parse_constraints(["t_small=row_wise"]))
    assert plan["sparse.ebc"]["t_small"].sharding_type == ShardingType.ROW_WISE
    assert plan["other.ebc"]["t_small"].sharding_type == ShardingType.ROW_WISE


def test_qualified_constraint_wins_over_bare_name():
    constraints = parse_constraints(["t_small=row_wise", "other.ebc:t_small=table_wise@1"])
    plan = plan_sharding(MIXED, 4, constraints=constraints)
    assert plan["sparse.ebc"]["t_small"].sharding_type == ShardingType.ROW_WISE
    assert plan["other.ebc"]["t_small"] == table_wise(50, 8, 1)


def test_constraint_that_cannot_fit_names_table_and_constraint():
    tables = {"": [table("t", 1000, 8)]}
    with pytest.raises(ValueError, match=r"table 't'.*constraint 'table_wise@1'.*relax"):
        plan_sharding(
            tables,
            4,
            memory_per_rank=10_000,
            constraints={"t": TableConstraint(("table_wise",), (1,))},
        )


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("t=table_wise@4", r"table 't' constraint 'table_wise@4'.*< world_size 4"),
        ("t=column_wise@0,1,2", r"3 column shards of a table with 2 columns"),
    ],
)
def test_impossible_constraints_are_errors(item, message):
    with pytest.raises(ValueError, match=message):
        plan_sharding({"": [table("t", 10, 2)]}, 4, constraints=parse_constraints([item]))


def test_column_wise_cannot_split_on_one_rank():
    with pytest.raises(
        ValueError, match="'t' .* has no placement under its constraint 'column_wise'"
    ):
        plan_sharding(
            {"": [table("t", 10, 8)]}, 1, constraints=parse_constraints(["t=column_wise"])
        )


def test_unknown_constraint_table_suggests_the_closest():
    with pytest.raises(ValueError, match=r"unknown tables 't_hgue' \(did you mean 't_huge'\?\)"):
        plan_sharding(MIXED, 2, constraints=parse_constraints(["t_hgue=row_wise"]))


def test_unknown_pooling_feature_suggests_the_closest():
    with pytest.raises(ValueError, match=r"'f_tuser' \(did you mean 'f_t_user'\?\)"):
        plan_sharding(MIXED, 2, pooling_factors={"f_tuser": 3.0})


def test_parse_constraints_good():
    parsed = parse_constraints(
        [
            "t_C1=row_wise",
            " t_C2 = table_wise @ 1 ",
            "a.b:t_C3=COLUMN_WISE@0,1",
            "t_C4=data_parallel",
        ]
    )
    assert parsed == {
        "t_C1": TableConstraint((ShardingType.ROW_WISE,)),
        "t_C2": TableConstraint((ShardingType.TABLE_WISE,), (1,)),
        "a.b:t_C3": TableConstraint((ShardingType.COLUMN_WISE,), (0, 1)),
        "t_C4": TableConstraint((ShardingType.DATA_PARALLEL,)),
    }
    assert str(parsed["a.b:t_C3"]) == "column_wise@0,1"
    assert parse_constraints([]) == {}


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("t_C1", r"'t_C1' is malformed; expected <table>=<type>\[@<rank>"),
        ("t_C1=", "malformed"),
        ("=row_wise", "malformed"),
        ("t=row_wise@", "malformed"),
        ("t=table_wise@a", "malformed"),
        ("t=table_wise@-1", "malformed"),
        (
            "t=rowwise",
            r"unknown sharding type 'rowwise' \(did you mean 'row_wise'\?\).*column_wise",
        ),
        ("t=Row_Wise", "unknown sharding type"),
        ("t=row_wise@1", "ranks need sharding type table_wise or column_wise"),
        ("t=column_wise@1,1", r"ranks \(1, 1\) must be distinct"),
    ],
)
def test_parse_constraints_bad(item, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_constraints([item])
    assert repr(item) in str(error.value)


def test_parse_constraints_rejects_a_table_given_twice():
    with pytest.raises(ValueError, match="'t' is constrained twice"):
        parse_constraints(["t=row_wise", "t=table_wise"])


def test_small_tables_are_data_parallel_and_large_ones_are_not():
    tables = {"": [table("tiny", 20, 16), table("small", 100, 16), table("large", 1_000_000, 16)]}
    for world_size in (2, 4, 8):
        plan = plan_sharding(tables, world_size, batch_size=1024)
        found = kinds(plan)
        assert found["tiny"] == found["small"] == ShardingType.DATA_PARALLEL, found
        assert found["large"] != ShardingType.DATA_PARALLEL, found


def test_data_parallel_loses_when_the_batch_is_small():
    # The all-reduce of a 5000-row table outweighs all-to-all of a batch of 8 samples...
    small_batch = plan_sharding({"": [table("t", 5000, 16)]}, 4, batch_size=8)
    assert kinds(small_batch)["t"] != ShardingType.DATA_PARALLEL
    # ...but not of 100k samples.
    big_batch = plan_sharding({"": [table("t", 5000, 16)]}, 4, batch_size=100_000)
    assert kinds(big_batch)["t"] == ShardingType.DATA_PARALLEL


def test_high_pooling_prefers_row_wise():
    tables = {"": [table("t", 1_000_000, 16)]}
    few = plan_sharding(tables, 4, pooling_factors={"f_t": 1.0})
    many = plan_sharding(tables, 4, pooling_factors={"f_t": 100.0})
    assert kinds(few)["t"] != ShardingType.ROW_WISE
    assert kinds(many)["t"] == ShardingType.ROW_WISE


def test_many_medium_tables_spread_table_wise_over_ranks():
    tables = {"": [table(f"t{i}", 50_000 * (i + 1), 64) for i in range(8)]}
    plan = plan_sharding(tables, 4)
    assert set(kinds(plan).values()) == {ShardingType.TABLE_WISE}
    assert sorted(s.ranks[0] for s in plan[""].values()) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_column_pieces_are_multiples_of_4():
    plan = plan_sharding({"": [table("t", 4_000_000, 36)]}, 4)
    sharding = plan[""]["t"]
    assert sharding.sharding_type == ShardingType.COLUMN_WISE, sharding
    widths = [s.num_cols for s in sharding.shards]
    assert sum(widths) == 36
    assert all(w % 4 == 0 for w in widths), widths


def test_same_input_gives_the_same_plan():
    kwargs = dict(memory_per_rank=2**30, optimizer_states=ROWWISE_ADAGRAD, batch_size=256)
    first = plan_sharding(MIXED, 4, **kwargs)
    second = plan_sharding(MIXED, 4, **kwargs)
    assert first == second
    assert first.describe() == second.describe()


def test_describe_lists_tables_ranks_and_memory():
    states = ROWWISE_ADAGRAD
    plan = plan_sharding(MIXED, 4, memory_per_rank=2**30, optimizer_states=states)
    text = plan.describe()
    lines = text.splitlines()
    assert "memory_per_rank 1.0 GiB" in lines[0]
    assert "sum per row" in text
    for path, configs in MIXED.items():
        for config in configs:
            line = next(x for x in lines if x.startswith(path) and f" {config.name} " in x)
            assert f"{config.num_embeddings} x {config.embedding_dim}" in line
            assert plan[path][config.name].sharding_type.name in line
    used = rank_bytes(plan, MIXED, states)
    for rank in range(4):
        line = next(x for x in lines if re.match(rf"{rank}\s+\d+\s", x))
        assert f"{used[rank] / 2**30:.1%}" in line
    assert re.search(r"sparse\.ebc\s+t_small\s+200 x 16\s+fp32\s+DATA_PARALLEL\s+0-3\s", text)
    assert "1.00" in text  # the busiest rank's relative cost


def test_describe_shows_the_cost_charged_for_each_table():
    plan = plan_sharding(MIXED, 4, memory_per_rank=2**30, optimizer_states=ROWWISE_ADAGRAD)
    lines = plan.describe().splitlines()
    assert lines[lines.index("") + 1].split()[-2:] == ["est.", "cost"]
    peak, costs = max(plan.rank_costs), []
    for path, configs in MIXED.items():
        for config in configs:
            cost = plan.footprints[path][config.name].cost
            assert cost > 0, config.name
            line = next(x for x in lines if x.startswith(path) and f" {config.name} " in x)
            assert line.split()[-1] == f"{cost / peak:.3f}", line
            costs.append(cost)
    # Every table's cost is charged to some rank: together they are the ranks' costs.
    assert sum(costs) == pytest.approx(sum(plan.rank_costs))


def test_describe_a_hand_built_plan():
    plan = ShardingPlan(
        2, {"": {"a": row_wise(11, 8, 2), "b": column_wise(5, 8, [1, 0]), "c": table_wise(3, 4, 1)}}
    )
    text = plan.describe()
    assert "hand-built plan: memory assumes fp32" in text
    assert re.search(r"\(root\)\s+a\s+11 x 8\s+fp32\?\s+ROW_WISE\s+0,1\s+160 B\.\.192 B", text)
    assert re.search(r"\(root\)\s+b\s+5 x 8\s+fp32\?\s+COLUMN_WISE\s+1,0\s+80 B", text)
    # rank 0: 6 rows x 8 of a + 5 x 4 of b = 68 floats; rank 1: 5 x 8 + 5 x 4 + 3 x 4 = 72.
    assert re.search(r"^0\s+2\s+272 B\s+-\s+-$", text, re.M)
    assert re.search(r"^1\s+3\s+288 B\s+-\s+-$", text, re.M)


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="world_size=0"):
        plan_sharding(MIXED, 0)
    with pytest.raises(ValueError, match="memory_per_rank=-1"):
        plan_sharding(MIXED, 2, memory_per_rank=-1)
    with pytest.raises(ValueError, match="'row' or 'element'"):
        plan_sharding(MIXED, 2, optimizer_states={"sum": "rows"})
    with pytest.raises(ValueError, match="data_type INT8"):
        plan_sharding({"": [table("t", 10, 4, DataType.INT8)]}, 2)


# Hand plans: check_plan and check_table_sharding


def test_check_plan_rejects_wrong_world_size():
    tables = {"": [table("t", 10, 4)]}
    with pytest.raises(ValueError, match="plan is for 2 ranks but this job has 4"):
        check_plan(ShardingPlan(2, {"": {"t": row_wise(10, 4, 2)}}), tables, 4)


def test_check_plan_rejects_missing_and_unknown_tables():
    tables = {"": [table("t", 10, 4), table("u", 10, 4)]}
    with pytest.raises(ValueError, match=r"lacks tables \['u'\] and names unknown tables \['v'\]"):
        check_plan(
            ShardingPlan(2, {"": {"t": table_wise(10, 4, 0), "v": table_wise(10, 4, 0)}}), tables, 2
        )
    with pytest.raises(ValueError, match="collections .'x'. that the model does not have"):
        check_plan(ShardingPlan(2, {"": {}, "x": {}}), tables, 2)


def test_check_table_sharding_rejects_bad_shards():
    config = table("t", 10, 8)
    overlapping = TableSharding(
        ShardingType.COLUMN_WISE, (Shard(0, 0, 10, 0, 6), Shard(1, 0, 10, 4, 4))
    )
    with pytest.raises(ValueError, match="not a COLUMN_WISE placement"):
        check_table_sharding(config, overlapping, 2)
    same_rank = column_wise(10, 8, [1, 1])
    with pytest.raises(ValueError, match="distinct ranks"):
        check_table_sharding(config, same_rank, 2)
    # Row blocks must be ceil(10 / 3) = 4 rows: 4, 4, 2.
    assert row_block(10, 3) == 4
    uneven = TableSharding(
        ShardingType.ROW_WISE, (Shard(0, 0, 3, 0, 8), Shard(1, 3, 3, 0, 8), Shard(2, 6, 4, 0, 8))
    )
    with pytest.raises(ValueError, match="not a ROW_WISE placement"):
        check_table_sharding(config, uneven, 3)
    with pytest.raises(ValueError, match="shard on rank 2; expected 0..1"):
        check_table_sharding(config, table_wise(10, 8, 2), 2)
    with pytest.raises(ValueError, match="not a DATA_PARALLEL placement"):
        check_table_sharding(config, data_parallel(10, 8, 2), 3)
    check_table_sharding(config, row_wise(10, 8, 3), 3)  # the valid one passes


def test_per_row_optimizer_state_is_never_column_wise():
    # The sharded collection refuses COLUMN_WISE with per-row state; the planner never offers it.
    for world_size in (2, 4, 8):
        plan = plan_sharding(MIXED, world_size, optimizer_states=ROWWISE_ADAGRAD)
        kinds = {s.sharding_type for c in plan.collections.values() for s in c.values()}
        assert ShardingType.COLUMN_WISE not in kinds
    plan = plan_sharding(MIXED, 4, optimizer_states={"sum": "element"})
    kinds = {s.sharding_type for c in plan.collections.values() for s in c.values()}
    assert ShardingType.COLUMN_WISE in kinds


def test_column_wise_constraint_with_per_row_state_says_why_it_cannot_be_placed():
    with pytest.raises(ValueError) as error:
        plan_sharding(
            {"": [table("t", 100, 16)]},
            2,
            optimizer_states=ROWWISE_ADAGRAD,
            constraints=parse_constraints(["t=column_wise"]),
        )
    message = str(error.value)
    assert "has no placement under its constraint 'column_wise' on 2 ranks" in message
    assert "per-row optimizer state (sum per row, e.g. rowwise_adagrad)" in message
    assert "cannot be split across column shards" in message
    assert "allow table_wise or row_wise" in message


# ---------------------------------------------------------------------------------------------
# Dynamic tables


def test_dynamic_tables_are_key_wise_over_every_rank_and_budget_their_cap():
    tables = [table("user", 1024, 16), table("item", 50_000, 16)]
    plan = plan_sharding({"": tables}, 4, dynamic_rows={"user": 1_000_000})
    user = plan[""]["user"]
    assert user.sharding_type == ShardingType.KEY_WISE
    assert sorted(user.ranks) == [0, 1, 2, 3]
    assert [s.num_rows for s in user.shards] == [250_000] * 4  # its cap, not its initial rows
    assert plan[""]["item"].sharding_type != ShardingType.KEY_WISE
    text = plan.describe()
    assert "<=1000000 x 16" in text and "KEY_WISE" in text
    # uncapped: its initial rows are budgeted
    uncapped = plan_sharding({"": tables}, 2, dynamic_rows={"user": 0})
    assert [s.num_rows for s in uncapped[""]["user"].shards] == [512, 512]


def test_a_dynamic_cap_beyond_memory_is_an_error_naming_the_table():
    tables = [table("user", 1024, 16)]
    with pytest.raises(ValueError, match="table 'user' \\(1000000 x 16"):
        plan_sharding({"": tables}, 2, memory_per_rank=2**20, dynamic_rows={"user": 1_000_000})


@pytest.mark.parametrize(
    ("constraint", "dynamic", "message"),
    [
        ("user=row_wise", {"user": 0}, "a dynamic table \\(raw ids\\) is sharded KEY_WISE only"),
        ("user=key_wise", {}, "KEY_WISE is for dynamic tables \\(raw ids\\) only"),
    ],
)
def test_key_wise_constraints_must_match_the_table(constraint, dynamic, message):
    with pytest.raises(ValueError, match=message):
        plan_sharding(
            {"": [table("user", 1024, 16)]},
            2,
            constraints=parse_constraints([constraint]),
            dynamic_rows=dynamic,
        )
    with pytest.raises(ValueError, match="dynamic_rows name unknown tables"):
        plan_sharding({"": [table("user", 1024, 16)]}, 2, dynamic_rows={"usr": 10})


def test_tiered_tables_budget_their_cache_and_keep_whole_rows():
    # 10M x 64 fp32 rows (+ a row-wise state) is 2.4 GiB, far over 64 MiB a rank; tiered, a
    # shard keeps a cache of 100k rows (+ the spare row) on the device, 25.6 MB, so it fits,
    # and only as TABLE_WISE or ROW_WISE (never split by column or replicated).
    tables = {"": [table("big", 10_000_000, 64), table("small", 100, 8)]}
    budget = 64 * 2**20
    with pytest.raises(ValueError, match="does not fit"):
        plan_sharding(tables, 2, memory_per_rank=budget, optimizer_states=ROWWISE_ADAGRAD)
    plan = plan_sharding(
        tables,
        2,
        memory_per_rank=budget,
        optimizer_states=ROWWISE_ADAGRAD,
        tiered_rows={"big": 100_000},
    )
    check_plan(plan, tables, 2)
    assert plan[""]["big"].sharding_type in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE)
    held = (100_000 + 1) * (64 * 4 + 4)
    assert max(plan.footprints[""]["big"].shard_bytes) == held
    described = plan.describe()
    assert "tiered: rows in host memory or on disk" in described
    assert re.search(r"big .*_WISE tiered", described)
    with pytest.raises(ValueError, match="tiered table .* table_wise or row_wise"):
        plan_sharding(
            tables,
            2,
            tiered_rows={"big": 100_000},
            constraints=parse_constraints(["big=column_wise"]),
        )


def test_a_dynamic_tiered_table_budgets_its_whole_cache_on_every_rank():
    # KEY_WISE over 2 ranks, 1000 initial rows (500 a part), a cache of 4096 rows on each.
    tables = {"": [table("keys", 1000, 16)]}
    plan = plan_sharding(tables, 2, dynamic_rows={"keys": 0}, tiered_rows={"keys": 4096})
    assert plan[""]["keys"].sharding_type == ShardingType.KEY_WISE
    assert plan.footprints[""]["keys"].shard_bytes == ((4096 + 1) * 16 * 4,) * 2
