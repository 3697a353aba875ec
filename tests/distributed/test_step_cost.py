"""The step cost model and the cluster topology behind ``recsys plan``: the bytes it predicts
against what the sharded collection's counters count on 4 gloo ranks (exactly), its split of
them inside and across nodes against a pairwise reference, flat and 2D; topology presets and
files and their calibration under torchrun; the planner in seconds; and the ``recsys plan``
command."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from recsys.build.sharding import plan_inputs, planner_options, step_inputs
from recsys.cli import main
from recsys.config import load_config
from recsys.config.sections import MLPERF_BAG_SIZES, MLPERF_TABLE_ROWS
from recsys.distributed import planner as P
from recsys.distributed.calibrate import fit_link
from recsys.distributed.id_profiles import IdProfile
from recsys.distributed.plan import ShardingPlan, ShardingType
from recsys.distributed.sharded import ShardedEmbeddingBagCollection
from recsys.distributed.step_cost import StepInputs, predict_step
from recsys.distributed.topology import (
    PRESETS,
    Topology,
    load_topology,
    save_topology,
    topology,
)
from recsys.embedding.collection import EmbeddingBagCollection
from recsys.embedding.optim import SGD
from recsys.train.metrics import read_metrics
from tests.distributed.spawn import run_ranks
from tests.distributed.test_torchrun import OVERRIDES, run_torchrun

# name, dim, rows, features, ids per bag (fixed): t_rw's 8 rows on 4 ranks are blocks of 2,
# and its bags hold one id of each block, so each row shard gets exactly a quarter of them.
TABLES = [
    ("t_tw", 6, 10, ["a"], 3),
    ("t_cw", 8, 12, ["b", "c"], 2),
    ("t_rw", 4, 8, ["d"], 4),
    ("t_dp", 5, 3, ["e"], 1),
]
POOLING = {f: float(n) for *_, features, n in TABLES for f in features}


def configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=fs)
        for name, dim, rows, fs, _ in TABLES
    ]


def four_rank_plan(world: int, with_dp: bool) -> ShardingPlan:
    shardings = {
        "t_tw": P.table_wise(10, 6, 1),
        "t_cw": P.column_wise(12, 8, [3, 0]),
        "t_rw": P.row_wise(8, 4, world),
        "t_dp": P.data_parallel(3, 5, world) if with_dp else P.table_wise(3, 5, 2),
    }
    return ShardingPlan(world, collections={"": shardings})


def fixed_bags(batch: int, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    values, lengths = [], []
    for _, _, rows, features, n in TABLES:
        for _ in features:
            if rows == 8:  # t_rw: ids 2k + (0 or 1), one per row block
                ids = 2 * torch.arange(4).repeat(batch) + torch.randint(
                    0, 2, (4 * batch,), generator=g
                )
            else:
                ids = torch.randint(0, rows, (n * batch,), generator=g)
            values.append(ids)
            lengths.append(torch.full((batch,), n))
    keys = [f for *_, features, _ in TABLES for f in features]
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def _counted_bytes(rank: int, world: int) -> None:
    batch = 5
    cluster = topology("h100_8x_ib400", ranks_per_node=2)
    cases = [(p, v, dp) for p in ("fp32", "fp16", "int8") for v in (True, False) for dp in (0, 1)]
    for precision, validate, with_dp in cases:
        torch.manual_seed(0)
        unsharded = EmbeddingBagCollection(configs(), optimizer=SGD(lr=0.1), validate=validate)
        plan = four_rank_plan(world, with_dp=bool(with_dp))
        sharded = ShardedEmbeddingBagCollection(
            unsharded,
            plan[""],
            forward_precision=precision,
            backward_precision=precision,
        )
        bags = fixed_bags(batch, seed=rank)
        profiles = {}
        if with_dp:  # t_dp replicated: every rank's bags read each of its 3 rows
            values = bags.values().clone()
            values[-batch:] = torch.arange(batch) % 3
            bags = KeyedJaggedTensor(keys=bags.keys(), values=values, lengths=bags.lengths())
            profiles = {"t_dp": IdProfile(np.array([3]), np.array([1.0]))}  # each row sure
        out = sharded(bags)
        out.values().sum().backward()
        inputs = StepInputs(
            batch,
            POOLING,
            forward_precision=precision,
            backward_precision=precision,
            extras=int(validate),
            id_profiles=profiles,
        )
        predicted = predict_step(plan, {"": configs()}, inputs, cluster)
        counted = sharded.comm_stats.bytes
        for part in ("input", "forward", "backward"):
            assert predicted.rank_bytes(part)[rank] == counted[part], (
                predicted.rank_bytes(part)[rank],
                counted[part],
                rank,
                precision,
                validate,
                with_dp,
                part,
            )


def test_predicted_bytes_equal_the_counted_bytes_on_four_ranks():
    run_ranks(4, _counted_bytes)


# ---------------------------------------------------------------------------------------------
# Inside and across nodes: against every (sender, receiver) pair


def pairwise(plan: ShardingPlan, replicas: int, per_node: int, batch: int) -> dict:
    """Bytes each world rank sends, by part and by where, summed pair by pair."""
    group = plan.world_size
    world = group * replicas
    out = {
        (p, w): np.zeros(world)
        for p in ("input", "forward", "backward")
        for w in ("intra", "inter")
    }
    slots = np.zeros(group)
    for config in configs():
        sharding = plan[""][config.name]
        if sharding.sharding_type == ShardingType.DATA_PARALLEL:
            continue
        total_rows = max(s.row_offset + s.num_rows for s in sharding.shards)
        by_rows = sharding.sharding_type == ShardingType.ROW_WISE
        pooling = sum(POOLING[f] for f in config.feature_names)
        for shard in sharding.shards:
            slots[shard.rank] += len(config.feature_names)
            share = shard.num_rows / total_rows if by_rows else 1.0
            for src in range(world):
                base = src - src % group
                owner = base + shard.rank
                where = "intra" if src // per_node == owner // per_node else "inter"
                ids = batch * pooling * share
                out["input", where][src] += 8 * (len(config.feature_names) * batch + ids)
                vectors = batch * shard.num_cols * len(config.feature_names) * 4
                out["backward", where][src] += vectors
                out["forward", where][owner] += vectors
    for src in range(world):
        base = src - src % group
        for dst in range(group):
            where = "intra" if src // per_node == (base + dst) // per_node else "inter"
            out["input", where][src] += 8 * (2 + slots[dst])
    return out


@pytest.mark.parametrize(("replicas", "per_node"), [(1, 2), (1, 4), (1, 8), (2, 2), (2, 8), (4, 1)])
def test_intra_and_inter_node_bytes_match_a_pairwise_count(replicas, per_node):
    group, batch = 4, 7
    plan = four_rank_plan(group, with_dp=False)
    cluster = topology("a100_8x_ib200", ranks_per_node=per_node)
    predicted = predict_step(
        plan, {"": configs()}, StepInputs(batch, POOLING, replicas=replicas), cluster
    )
    expected = pairwise(plan, replicas, per_node, batch)
    for key, value in expected.items():
        np.testing.assert_allclose(predicted.sent[key], value, rtol=1e-12, err_msg=str(key))


def test_two_dimensional_plans_keep_the_all_to_alls_inside_a_node():
    plan = four_rank_plan(4, with_dp=False)
    cluster = topology("h100_8x_ib400", ranks_per_node=4)
    flat = predict_step(
        ShardingPlan(16, collections={"": {
            "t_tw": P.table_wise(10, 6, 9),
            "t_cw": P.column_wise(12, 8, [3, 12]),
            "t_rw": P.row_wise(8, 4, 16),
            "t_dp": P.table_wise(3, 5, 2),
        }}),
        {"": configs()},
        StepInputs(32, POOLING),
        cluster,
    )  # fmt: skip
    two_d = predict_step(
        plan, {"": configs()}, StepInputs(32, POOLING, replicas=4, sync_every=10), cluster
    )
    for part in ("input", "forward", "backward"):
        assert flat.rank_bytes(part, "inter").max() > 0
        assert two_d.rank_bytes(part, "inter").max() == 0
    # The replica sync: 2 (R - 1) / R of each rank's shards, every 10 steps.
    np.testing.assert_allclose(
        two_d.rank_bytes("replica_sync", "inter")[:4], 2 * 3 / 4 * two_d.table_bytes / 10
    )
    assert two_d.seconds["replica_sync"] > 0 and flat.seconds["replica_sync"] == 0
    text = two_d.describe()
    assert "2D: 4 replicas of 4" in text and "predicted step" in text


def test_memory_per_rank_is_the_plans_shards():
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=1000 * (i + 1), embedding_dim=16,
                           feature_names=[f"f{i}"])
        for i in range(6)
    ]  # fmt: skip
    states = {"sum": "row"}
    plan = P.plan_sharding({"": tables}, 4, optimizer_states=states)
    predicted = predict_step(
        plan, {"": tables}, StepInputs(64, optimizer_states=states), PRESETS["cpu_host"]
    )
    held = np.zeros(4)  # each shard's fp32 rows and their one fp32 accumulator each
    for sharding in plan[""].values():
        for shard in sharding.shards:
            held[shard.rank] += shard.num_rows * (shard.num_cols * 4 + 4)
    np.testing.assert_array_equal(predicted.table_bytes, held)


# ---------------------------------------------------------------------------------------------
# Topology


def test_presets_name_their_sources_and_files_round_trip(tmp_path):
    for name, preset in PRESETS.items():
        assert preset.name == name and preset.source
    path = tmp_path / "cluster.toml"
    measured = Topology("calibrated", 2, 1.5, 80.0, 0.4, 300.0, 12.0, 16.0, 0.1, 'a "quoted" note')
    calibrated = replace(measured, op_us=3.5, host_share=2.5, sync_wait_us=750.0, device="cpu")
    for figures in (measured, calibrated):
        save_topology(figures, path)
        assert load_topology(path) == figures
    assert "host work 2.5x slower, 750 us waiting per collective" in load_topology(path).describe()
    # a file written before the per-op floor and the host share: none, and no sharing
    lines = path.read_text().splitlines()
    old = ("op_us", "host", "sync_wait", "device")
    path.write_text("\n".join(line for line in lines if not line.startswith(old)))
    older = load_topology(path)
    assert (older.op_us, older.host_share, older.sync_wait_us) == (0.0, 1.0, 0.0)
    assert load_topology(path).device == ""  # as a preset: no host measured
    path.write_text('preset = "a100_8x_ib200"\ninter_gbs = 12.5\n')
    assert load_topology(path) == Topology(**{**vars(PRESETS["a100_8x_ib200"]), "inter_gbs": 12.5})
    assert topology(path=path, ranks_per_node=4).ranks_per_node == 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('preset = "h100_8x_ib40"', "did you mean 'h100_8x_ib400'"),
        (
            'preset = "cpu_host"\nintra_gb = 3.0',
            "unknown keys ['intra_gb'] (did you mean 'intra_gbs'?)",
        ),
        ("name = 'x'\nranks_per_node = 2", "lacks ['dense_tflops'"),
        ('preset = "cpu_host"\nmemory_gbs = -1.0', "memory_gbs = -1.0; expected > 0"),
        (
            'preset = "cpu_host"\ndense_fp32_tflops = -2.0',
            "dense_fp32_tflops = -2.0; expected >= 0",
        ),
        ('preset = "cpu_host"\nhost_share = 0.5', "host_share = 0.5; expected >= 1"),
        ('preset = "cpu_host"\nsync_wait_us = -1.0', "sync_wait_us = -1.0; expected >= 0"),
        ("name = [", "is not valid TOML"),
    ],
)
def test_bad_topology_files_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match="") as error:
        load_topology(path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_per_op_floor_is_measured_as_a_step_runs_ops():
    from recsys.distributed.calibrate import _op_us

    per_op = _op_us(torch.device("cpu"), seconds=0.05)
    # a tiny op forward and back: microseconds of dispatch and autograd, not nothing, not ms
    assert 0.05 < per_op < 1000


def _one_table_step(**inputs):
    table = EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100, feature_names=["f"])
    plan = P.plan_sharding({"": [table]}, 2)
    return lambda topology: predict_step(plan, {"": [table]}, StepInputs(64, **inputs), topology)


def test_batches_made_inside_the_step_add_to_it_on_the_launchs_hosts():
    cpu = PRESETS["cpu_host"]
    without = _one_table_step()(cpu)
    assert without.seconds["data"] == 0.0
    inline = _one_table_step(input_s=0.002)
    # ranks sharing cores make their batches host_share times more slowly, inside the step
    for share in (1.0, 3.0):
        step = inline(replace(cpu, host_share=share))
        assert step.seconds["data"] == pytest.approx(0.002 * share)
        assert step.step_s == pytest.approx(without.step_s + 0.002 * share)
    # made beside the step (loader workers, prefetching): only what exceeds the rest counts
    beside = _one_table_step(input_s=without.step_s / 2, input_inline=False)
    assert beside(cpu).seconds["data"] == 0.0
    # ... and the launch's hosts make it host_share times more slowly there too
    shared = beside(replace(cpu, host_share=3.0))
    assert shared.seconds["data"] == pytest.approx(without.step_s / 2)  # 1.5 x the rest - rest
    slow = _one_table_step(input_s=without.step_s + 0.005, input_inline=False)(cpu)
    assert slow.seconds["data"] == pytest.approx(0.005)
    assert slow.step_s == pytest.approx(without.step_s + 0.005)


@pytest.mark.parametrize(
    ("overrides", "inline"),
    [
        (["--run.device=cpu"], True),  # auto: no prefetching on CPU; 1 CPU a rank: no workers
        (["--run.device=cpu", "--data.prefetch_batches=2"], False),
        (["--run.device=cpu", "--data.loader_workers=1"], False),
        (["--run.device=cuda"], False),  # auto: 4 batches prefetched on CUDA
        (["--run.device=auto"], "cuda"),  # as the calibrated hosts train, not this one
    ],
)
def test_where_the_trainer_makes_its_batches(overrides, inline, monkeypatch):
    from recsys.build.sharding import batch_makers

    monkeypatch.setattr("recsys.data.loader.usable_cpus", lambda: 2)
    config = load_config("configs/dlrm_synthetic.toml", overrides)
    if inline == "cuda":  # run.device = "auto": the training hosts' device decides
        assert batch_makers(config, 2, cuda=True) == (0, True)
        assert batch_makers(config, 2, cuda=False) == (0, False)
        return
    workers, prefetched = batch_makers(config, ranks_per_node=2)
    assert (workers == 0 and not prefetched) is inline
    assert batch_makers(config, ranks_per_node=1)[0] == 1  # 2 CPUs a rank: one worker


def test_plan_inputs_time_the_train_loader_when_asked(monkeypatch):
    import recsys.build.sharding as sharding

    config = load_config(
        "configs/dlrm_synthetic.toml", ["--run.device=cpu", "--train.batch_size=256"]
    )
    untimed = plan_inputs(config)
    assert untimed.input_s == 0.0 and untimed.input_source == "not measured"

    class Clock:  # 1 ms a reading: both timings below read the same batches the same way
        def __init__(self):
            self.now = 0.0

        def perf_counter(self):
            self.now += 1e-3
            return self.now

    monkeypatch.setattr(sharding, "time", Clock())
    timed = plan_inputs(config, time_input=True, ranks_per_node=2)
    assert 0 < timed.input_s < 1.0 and timed.input_inline
    assert "a batch of 256 on this host" in timed.input_source
    assert timed.input_source.endswith("made inside the step")
    assert step_inputs(config, timed, pipeline=False).input_s == timed.input_s
    # two loader workers share the batches out: each batch half the time, beside the step
    workers = load_config(
        "configs/dlrm_synthetic.toml",
        ["--run.device=cpu", "--train.batch_size=256", "--data.loader_workers=2"],
    )
    monkeypatch.setattr(sharding, "time", Clock())
    shared = plan_inputs(workers, time_input=True, ranks_per_node=2)
    assert not shared.input_inline and "shared by 2 loader workers" in shared.input_source
    assert shared.input_source.endswith("made beside the step (workers or prefetching)")
    assert shared.input_s == pytest.approx(timed.input_s / 2)


def test_dense_work_is_charged_at_the_training_precisions_rate(tmp_path):
    h100 = PRESETS["h100_8x_ib400"]
    assert (h100.dense_rate("fp32"), h100.dense_rate("bf16"), h100.dense_rate("fp16")) == (
        67.0,
        989.0,
        989.0,
    )
    assert "dense 989 TFLOP/s (fp32 67)" in h100.describe()
    # a calibrated topology measured one rate (fp32 matmuls): it serves every precision
    path = tmp_path / "calibrated.toml"
    save_topology(replace(PRESETS["cpu_host"], name="calibrated", dense_tflops=0.2), path)
    calibrated = load_topology(path)
    assert calibrated.dense_fp32_tflops == 0.0
    assert calibrated.dense_rate("fp32") == calibrated.dense_rate("bf16") == 0.2
    plan = four_rank_plan(4, with_dp=False)
    seconds = {
        precision: predict_step(
            plan,
            {"": configs()},
            StepInputs(64, dense_parameters=10**6, dense_precision=precision),
            h100,
        ).seconds["dense"]
        for precision in ("fp32", "bf16")
    }
    assert seconds["fp32"] == pytest.approx(6 * 10**6 * 64 / 67e12)
    assert seconds["fp32"] / seconds["bf16"] == pytest.approx(989 / 67)
    config = load_config(None, ["--train.precision=bf16"])
    assert step_inputs(config, plan_inputs(config), pipeline=False).dense_precision == "bf16"


def test_topology_arguments_are_checked():
    with pytest.raises(ValueError, match="did you mean 'cpu_host'"):
        topology("cpu_hots")
    with pytest.raises(ValueError, match="not both"):
        topology("cpu_host", "x.toml")
    with pytest.raises(FileNotFoundError, match="'missing.toml' not found"):
        topology(path="missing.toml")


# ---------------------------------------------------------------------------------------------
# The planner in seconds


def mlperf_tables() -> tuple[list[EmbeddingBagConfig], dict[str, float]]:
    tables = [
        EmbeddingBagConfig(name=f"t_cat_{i}", num_embeddings=rows, embedding_dim=128,
                           feature_names=[f"cat_{i}"])
        for i, rows in enumerate(MLPERF_TABLE_ROWS)
    ]  # fmt: skip
    return tables, {f"cat_{i}": float(n) for i, n in enumerate(MLPERF_BAG_SIZES)}


@pytest.mark.parametrize("world", [8, 64])
def test_planning_in_seconds_predicts_a_faster_step_than_planning_in_bytes(world):
    tables, pooling = mlperf_tables()
    states, cluster = {"sum": "element"}, PRESETS["h100_8x_ib400"]
    options = dict(
        memory_per_rank=79 * 2**30, optimizer_states=states, batch_size=8192,
        pooling_factors=pooling,
    )  # fmt: skip
    inputs = StepInputs(8192, pooling, states, dense_parameters=16_000_000)
    steps = {}
    for planned_for in (None, cluster):
        plan = P.plan_sharding({"": tables}, world, topology=planned_for, **options)
        P.check_plan(plan, {"": tables}, world)
        steps[planned_for is None] = predict_step(plan, {"": tables}, inputs, cluster).step_s
    assert steps[False] < steps[True]


def test_large_worlds_try_the_cheapest_rank_for_a_whole_table(monkeypatch):
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=500 + 37 * i, embedding_dim=8,
                           feature_names=[f"f{i}"])
        for i in range(40)
    ]  # fmt: skip
    constraints = {f"t{i}": P.TableConstraint((ShardingType.TABLE_WISE,)) for i in range(0, 40, 3)}
    options = dict(memory_per_rank=2 * 2**20, constraints=constraints, batch_size=64)
    fast = P.plan_sharding({"": tables}, 80, **options)
    monkeypatch.setattr(P, "_ALL_RANKS_UP_TO", 10**6)
    every_rank = P.plan_sharding({"": tables}, 80, **options)
    assert fast.collections == every_rank.collections


def test_mlperf_tables_plan_for_4096_ranks_in_seconds():
    tables, pooling = mlperf_tables()
    plan = P.plan_sharding(
        {"": tables}, 4096, memory_per_rank=79 * 2**30, optimizer_states={"sum": "row"},
        batch_size=8192, pooling_factors=pooling, topology=PRESETS["h100_8x_ib400"],
    )  # fmt: skip
    P.check_plan(plan, {"": tables}, 4096)
    inputs = StepInputs(8192, pooling, {"sum": "row"})
    assert math.isfinite(predict_step(plan, {"": tables}, inputs, PRESETS["h100_8x_ib400"]).step_s)


# ---------------------------------------------------------------------------------------------
# recsys plan


def test_recsys_plan_prints_flat_and_2d_plans_with_their_predictions(capsys):
    code = main(
        ["plan", "--config", "configs/dlrm_synthetic.toml", "--world-size", "8",
         "--ranks-per-node", "4", "--hardware", "a100_8x_ib200"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "planner cost: predicted seconds on this cluster" in out
    assert "== flat: tables over all 8 ranks ==" in out
    assert "== 2D: tables over groups of 4 ranks, 2 replicas, synced every step ==" in out
    assert out.count("predicted step") == 2 and "samples/s" in out


def test_plan_inputs_read_the_first_train_chunk_of_real_data_once(tmp_path, monkeypatch):
    from recsys.data.criteo import CriteoDataset
    from tests.data.test_criteo import line, write

    rng = np.random.default_rng(0)
    cats = [[f"{rng.integers(1000):08x}" for _ in range(26)] for _ in range(300)]
    path = write(tmp_path / "day.txt", [line(label=str(k % 2), cats=c) for k, c in enumerate(cats)])
    reads = []
    chunk = CriteoDataset.chunk
    monkeypatch.setattr(CriteoDataset, "chunk", lambda self, *a: reads.append(a) or chunk(self, *a))
    config = load_config(
        "configs/dlrm_synthetic.toml", [f"--data.path={path}", "--data.criteo.hash_buckets=97"]
    )
    inputs = plan_inputs(config)
    assert reads == [("train", 0)]  # the pooling factors and the id profiles share one read
    assert inputs.pooling_factors == {f"cat_{i}": 1.0 for i in range(26)}
    assert (
        "first train chunk" in inputs.pooling_source
        and "first train chunk" in inputs.profile_source
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world-size", "8", "--replicas", "3"], "--replicas 3: expected a divisor"),
        (["--world-size", "0"], "--world-size 0; expected >= 1"),
        (["--world-size", "8", "--hardware", "h100"], "distributed.hardware"),
        (["--calibrate", "x.toml"], "--calibrate measures the links between ranks"),
    ],
)
def test_recsys_plan_bad_arguments_are_one_line_errors(capsys, args, message):
    code = main(["plan", "--config", "configs/dlrm_synthetic.toml", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.count("\n") == 1


# ---------------------------------------------------------------------------------------------
# Calibration


def test_link_fit_recovers_latency_and_bandwidth():
    sizes = [1e3, 1e5, 1e6, 4e6]
    gbs, latency = fit_link(sizes, [30e-6 + s / 2e9 for s in sizes])
    assert gbs == pytest.approx(2.0) and latency == pytest.approx(30.0)
    # Faster than the timer: no slope; the largest size over the largest time.
    assert fit_link(sizes, [5e-6] * 4) == pytest.approx((4e6 / 5e-6 / 1e9, 5.0))


def test_calibration_under_torchrun_writes_a_topology_file(tmp_path, capsys):
    path = tmp_path / "cluster.toml"
    done = run_torchrun(
        ["--nproc-per-node=2", "-m", "recsys", "plan", "--calibrate", str(path)], timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("recsys: wrote") == 1  # rank 0 alone
    measured = load_topology(path)
    assert measured.ranks_per_node == 2 and measured.name.startswith("calibrated (gloo, 1 x 2")
    assert measured.host_share < 50 and measured.device == "cpu"
    assert 0 <= measured.sync_wait_us < 1e6
    text = path.read_text()
    assert "# all-reduce (median)" in text and "no inter-node link measured" in text
    assert measured.inter_gbs == measured.intra_gbs  # one node: repeated
    # The file plans like a preset.
    code = main(
        ["plan", "--config", "configs/dlrm_synthetic.toml", "--world-size", "2",
         "--topology", str(path)]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out  # the batches timed here, for the calibrated hosts
    assert "ms a batch of 2,048 on this host" in out
    # ... and so is the ranks' step, each with its peers mirrored, in place of the modelled
    # lookups, dense part and updates, and of the batches made inside it
    assert "compute: " in out and "ranks 0-1 of 2 timed on this host with their peers" in out
    predicted = out.split("predicted ms per step: ")[1].split("\n")[0]
    assert predicted.startswith("compute ") and "lookup" not in predicted
    # the trainer pipelines on CUDA only (train.pipeline = "auto"): on CPU hosts the input
    # dist is not hidden behind the forward
    assert "input_dist" in predicted


def test_a_training_runs_bytes_per_step_are_the_predicted_ones(tmp_path):
    """``recsys train`` on 2 gloo ranks logs ``comm_bytes_<kind>`` per step and its tables'
    bytes (rank 0's); with fixed bags, whole tables (no id spread over row shards) and a
    replicated table every batch reads all of (4 rows: its touched-row counts, bitmap and
    gradient exchange fixed) they are what ``recsys plan``'s prediction says, byte for byte."""
    placed = [f'"t_cat_{i}=table_wise"' for i in range(3)] + ['"t_cat_3=data_parallel"']
    overrides = [
        *OVERRIDES,
        "--data.synthetic.cardinalities=[100,1000,500,4]",
        "--data.synthetic.bag_sizes=[1,3,2,1]",
        "--data.synthetic.bag_lengths=fixed",
        "--distributed.constraints=[" + ",".join(placed) + "]",
        "--train.eval_every_steps=32",  # evaluations between the windows are left out
    ]
    done = run_torchrun(
        ["--nproc-per-node=2", "-m", "recsys", "train", f"--run.dir={tmp_path}", *overrides]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    events = read_metrics(tmp_path / "metrics.jsonl")
    train = [e for e in events if e["split"] == "train"]
    config = load_config(None, overrides)
    inputs = plan_inputs(config)
    plan = inputs.plan(2, planner_options(config))
    step = step_inputs(config, inputs, pipeline=False)
    predicted = predict_step(plan, inputs.configs, step, PRESETS["cpu_host"])
    (sharding,) = [e for e in events if e["split"] == "sharding"]
    assert sharding["table_bytes"] == predicted.table_bytes[0]  # weights and Adagrad's state
    for event in train:
        for kind in ("input", "forward", "backward"):
            assert event[f"comm_bytes_{kind}"] == predicted.rank_bytes(kind)[0], (kind, event)


def test_every_collective_of_a_step_pays_its_latency():
    # Links so fast that only latencies count, and no dense part: the input dist is two
    # all-to-alls (the counts, then the ids), the pooled vectors and their gradients one each,
    # the replicated table's all-gather one more (beside DDP's ring of 2 log2(W) latencies).
    cluster = replace(PRESETS["cpu_host"], ranks_per_node=4, intra_gbs=1e9, intra_latency_us=100.0)
    inputs = StepInputs(64)
    flat = predict_step(four_rank_plan(4, with_dp=False), {"": configs()}, inputs, cluster)
    assert flat.seconds["input_dist"] == pytest.approx(2e-4, rel=1e-6)
    assert flat.seconds["output_dist"] == pytest.approx(1e-4, rel=1e-6)
    assert flat.seconds["grad_dist"] == pytest.approx(1e-4, rel=1e-6)
    assert flat.seconds["allreduce"] == pytest.approx(4 * 1e-4, rel=1e-6)  # 2 log2(4)
    replicated = predict_step(four_rank_plan(4, with_dp=True), {"": configs()}, inputs, cluster)
    assert replicated.seconds["allreduce"] == pytest.approx(5 * 1e-4, rel=1e-6)
    # Ranks sharing cores also wait for each other at each collective they meet at: the two of
    # the input dist, one each for the vectors and gradients, DDP's end and the all-gather.
    waiting = replace(cluster, sync_wait_us=30.0)
    flat = predict_step(four_rank_plan(4, with_dp=False), {"": configs()}, inputs, waiting)
    assert flat.seconds["input_dist"] == pytest.approx(2 * 130e-6, rel=1e-6)
    assert flat.seconds["output_dist"] == flat.seconds["grad_dist"] == pytest.approx(130e-6)
    assert flat.seconds["allreduce"] == pytest.approx(4e-4 + 30e-6, rel=1e-6)
    replicated = predict_step(four_rank_plan(4, with_dp=True), {"": configs()}, inputs, waiting)
    assert replicated.seconds["allreduce"] == pytest.approx(5e-4 + 2 * 30e-6, rel=1e-6)
    # A dense part long enough to hide DDP's ring: the all-gather, in the embeddings' backward
    # after it, still counts whole.
    dense = StepInputs(64, dense_parameters=10**8)
    hidden = predict_step(four_rank_plan(4, with_dp=False), {"": configs()}, dense, cluster)
    assert hidden.seconds["allreduce"] == 0.0
    gathered = predict_step(four_rank_plan(4, with_dp=True), {"": configs()}, dense, cluster)
    assert gathered.seconds["allreduce"] == pytest.approx(1e-4, rel=1e-3)


def test_a_timed_rank_compute_stands_for_the_modelled_lookups_dense_part_and_updates():
    cpu = PRESETS["cpu_host"]
    modelled = _one_table_step()(cpu)
    assert modelled.seconds["compute"] == 0.0
    assert modelled.seconds["lookup"] > 0 and modelled.seconds["update"] > 0
    for share in (1.0, 2.5):
        timed = _one_table_step(compute_s=0.004)(replace(cpu, host_share=share))
        assert timed.seconds["compute"] == pytest.approx(0.004 * share)
        assert timed.seconds["lookup"] == timed.seconds["dense"] == timed.seconds["update"] == 0
        rest = modelled.step_s - sum(modelled.seconds[p] for p in ("lookup", "dense", "update"))
        assert timed.step_s == pytest.approx(rest + 0.004 * share)
    assert "compute 4.000" in _one_table_step(compute_s=0.004)(cpu).describe()
    # batches made inside the step were made in the timed step; beside it, as before
    assert _one_table_step(input_s=0.002, compute_s=0.004)(cpu).seconds["data"] == 0.0
    beside = _one_table_step(input_s=1.0, input_inline=False, compute_s=0.004)(cpu)
    assert beside.step_s == pytest.approx(1.0)  # a loader slower than the rest sets the step


@pytest.mark.parametrize("recipe", ["sasrec_synthetic", "hstu_synthetic", "hstu_ranking_synthetic"])
def test_plan_refuses_models_of_user_histories_in_one_line(recipe):
    config = load_config(f"configs/{recipe}.toml", [])
    with pytest.raises(ValueError, match="recsys plan plans click models") as error:
        plan_inputs(config)
    assert "\n" not in str(error.value)
