"""One steady-state step of the default recipe (configs/dlrm_synthetic.toml: 26 fixed tables,
one process, ``train.id_checks = "async"`` as on a GPU) waits on the host nowhere and stays in
its recorded budget of kernel-like ops (what :mod:`recsys.train.step_audit` counts). A change
that adds a sync fails here naming its file:line; one that adds ops names the files that grew.
TorchRec's DistributedModelParallel step on the same model: 101 ops (benchmarks/step_audit.py).
"""

from recsys.config import load_config
from recsys.train.step_audit import audit_training

# Kernel-like ops per step, by file, when the budget was recorded (100 in all).
RECORDED_OPS = {
    "recsys/ops/input_checks.py": 37,
    "recsys/train/step.py": 38,
    "recsys/ops/dot_interaction.py": 7,
    "recsys/ops/fused_mlp.py": 5,
    "recsys/ops/fused_mlp_activations.py": 4,
    "recsys/ops/embedding_bag_cpu.py": 4,
    "recsys/ops/embedding_bag.py": 2,
    "recsys/ops/embedding_bag_layout.py": 1,
    "recsys/embedding/collection.py": 1,
    "recsys/train/progress.py": 1,
}
OPS_BUDGET = sum(RECORDED_OPS.values())


def test_default_recipe_step_has_no_sync_and_keeps_its_op_budget(tmp_path):
    config = load_config(
        "configs/dlrm_synthetic.toml",
        [
            f"--run.dir={tmp_path / 'run'}",
            "--run.device=cpu",
            "--train.progress_bar=false",
            "--train.log_every_steps=1000",  # the audited step logs, evaluates and saves nothing
            "--train.eval_every_steps=0",
            "--checkpoint.save_final=false",
            "--data.prefetch_batches=2",  # batches built in the loader's thread
            "--data.synthetic.num_train_samples=20480",
            '--train.id_checks="async"',
        ],
    )
    report = audit_training(config, warmup=3, steps=1)
    assert report.num_syncs == 0, "host syncs in the training step:\n" + report.describe()
    grown = {
        path: f"{RECORDED_OPS.get(path, 0)} -> {count}"
        for path, count in report.ops_by_file().items()
        if count > RECORDED_OPS.get(path, 0)
    }
    assert report.num_ops <= OPS_BUDGET, (
        f"{report.num_ops} kernel-like ops per step, budget {OPS_BUDGET}; grown: {grown}\n"
        + report.describe()
    )
