"""StepAudit on small hand-written snippets: each sync it must see, attributed to the snippet's
line; what it must not count (views, allocations, torch.optim's step counter, another thread's
work, host work on a device run); kernel-like ops and collectives counted where they run."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from recsys.train.step_audit import AuditReport, StepAudit

# Each snippet sits on one line of this file, which is where the audit must place it (the
# innermost frame outside torch: there is no recsys frame on the stack).
SYNCS = {
    "item": (lambda x, ids: x.sum().item(), "_local_scalar_dense"),
    "int": (lambda x, ids: int(ids[0]), "_local_scalar_dense"),
    "bool": (lambda x, ids: bool(x[0] > 1), "_local_scalar_dense"),
    "float": (lambda x, ids: float(x.max()), "_local_scalar_dense"),
    "tolist": (lambda x, ids: ids.tolist(), "tolist"),
    "numpy": (lambda x, ids: x.numpy(), "numpy"),
    "nonzero": (lambda x, ids: x.nonzero(), "nonzero"),
    "where": (lambda x, ids: torch.where(x > 1), "nonzero"),
    "mask_index": (lambda x, ids: x[x > 1], "index"),
    "mask_put": (lambda x, ids: x.clone().index_put_((x > 1,), x.new_zeros(())), "index_put_"),
    "masked_select": (lambda x, ids: x.masked_select(x > 1), "masked_select"),
    "unique": (lambda x, ids: torch.unique(ids), "_unique2"),
    "unique_consecutive": (lambda x, ids: torch.unique_consecutive(ids), "unique_consecutive"),
    "repeat_interleave": (lambda x, ids: torch.repeat_interleave(x, ids), "repeat_interleave"),
    "tensor_from_list": (lambda x, ids: torch.tensor([1, 2, 3]), "lift_fresh"),
}


def here(fn) -> str:
    return f"{__file__}:{fn.__code__.co_firstlineno}"


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.rand(5, generator=g) * 3, torch.randint(1, 4, (5,), generator=g)


@pytest.mark.parametrize("name", list(SYNCS))
def test_each_sync_is_seen_once_at_its_line(name):
    snippet, op = SYNCS[name]
    x, ids = inputs()
    with StepAudit() as report:
        snippet(x, ids)
    assert report.syncs == [(op, here(snippet))], report.describe()
    assert f"sync {op} at {here(snippet)}" in report.describe()


def test_repeat_interleave_with_output_size_is_no_sync():
    x, ids = inputs()
    total = int(ids.sum())
    with StepAudit() as report:
        out = torch.repeat_interleave(x, ids, output_size=total)
    assert report.num_syncs == 0, report.describe()
    assert report.op_names == {"repeat_interleave": 1, "index_select": 1}
    assert out.numel() == total


def test_kernel_like_ops_counted_per_line_and_views_and_allocations_are_not():
    x, ids = inputs()
    w = torch.rand(5, 3)
    arith = lambda: x * 2 + 1  # noqa: E731 - two kernels
    matmul = lambda: x @ w  # noqa: E731 - one
    with StepAudit() as report:
        views = (x.view(5, 1), x.reshape(1, 5), w.t(), x[1:3], x.detach(), x.unsqueeze(0))
        buffers = (torch.empty(4), torch.empty_like(x), x.new_empty(2), torch.empty(2, 3).t())
        arith()
        matmul()
    assert report.num_syncs == 0 and report.num_collectives == 0, report.describe()
    assert report.ops == {here(arith): 2, here(matmul): 1}, report.describe()
    assert report.op_names == {"mul": 1, "add": 1, "mm": 1}  # and a free squeeze_
    assert report.ops_by_file() == {__file__: 3}
    assert len(views) + len(buffers) == 10


def test_torch_optim_step_counter_is_exempt_a_users_item_is_not():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizers = [torch.optim.Adam(model.parameters(), lr=1e-3, foreach=f) for f in (False, True)]
    optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.rand(16, 4)
    for optimizer in optimizers:
        for _ in range(2):  # the second step reads the step counter of existing state
            optimizer.zero_grad()
            model(x).square().mean().backward()
            with StepAudit() as report:
                optimizer.step()
            assert report.num_syncs == 0, report.describe()
            assert report.num_ops > 0
    loss = model(x).square().mean()
    with StepAudit() as report:
        read = lambda: loss.item()  # noqa: E731 - the sync's line
        read()
    assert report.syncs == [("_local_scalar_dense", here(read))]


def test_another_threads_work_is_not_counted():
    x, ids = inputs()
    done = []

    def loader() -> None:
        done.append((x.sum().item(), ids.tolist(), torch.unique(ids), x * 2))

    with StepAudit() as report:
        thread = threading.Thread(target=loader)
        thread.start()
        thread.join()
        y = x + 1  # the audited thread's one op
    assert done and y.numel() == 5
    assert report.num_syncs == 0 and report.num_ops == 1, report.describe()


def test_host_work_on_a_device_run_is_no_sync_a_blocking_copy_is():
    x, ids = inputs()
    with StepAudit("meta") as report:  # a device run on host tensors
        x.sum().item(), ids.tolist(), torch.unique(ids), x[x > 1]
    assert report.num_syncs == 0, report.describe()
    with StepAudit("meta") as report:
        x.to("meta", non_blocking=True)
        copy = lambda: x.to("meta")  # noqa: E731 - the sync's line
        copy()
    assert report.syncs == [("_to_copy", here(copy))], report.describe()


def test_collectives_counted_at_their_line():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.ones(4)
        reduce = lambda: dist.all_reduce(x)  # noqa: E731
        exchange = lambda: dist.all_to_all_single(torch.empty(4), x)  # noqa: E731
        with StepAudit() as report:
            reduce()
            exchange()
    finally:
        dist.destroy_process_group()
    assert report.collectives == [("allreduce_", here(reduce)), ("alltoall_base_", here(exchange))]
    assert report.num_syncs == 0 and report.num_ops == 0, report.describe()


def test_recsys_frames_are_the_sites_relative_to_the_package():
    from recsys.ops.interaction.dot import dot_interaction

    dense, sparse = torch.rand(4, 8), torch.rand(4, 3, 8)
    with StepAudit() as report:
        dot_interaction(dense, sparse)
    assert report.num_ops > 0
    sites = [*report.ops, *(site for _, site in report.syncs)]
    assert all(site.startswith("recsys/ops/") for site in sites), report.describe()


def test_scaled_gives_per_step_counts():
    report = AuditReport(syncs=[("nonzero", "recsys/a.py:3")] * 4)
    report.ops.update({"recsys/a.py:3": 8, "recsys/b.py:1": 4})
    per_step = report.scaled(4)
    assert per_step.syncs == [("nonzero", "recsys/a.py:3")]
    assert per_step.num_ops == 3
    assert per_step.ops_by_file() == {"recsys/a.py": 2, "recsys/b.py": 1}
