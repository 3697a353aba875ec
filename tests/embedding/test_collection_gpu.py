"""The compiled Triton kernels on a CUDA device against the CPU float64 reference (run by
``scripts/gpu_check.sh``; skipped without a GPU)."""

import pytest
import torch

from recsys import EmbeddingBagCollection
from recsys.embedding.optim import SGD, Adam, RowWiseAdagrad
from tests.embedding.test_optim import (
    Reference,
    batches_and_upstreams,
    table_configs,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "optimizer", [SGD(lr=0.1), RowWiseAdagrad(lr=0.1), Adam(lr=0.01)], ids=repr
)
def test_triton_fused_update_on_cuda_matches_reference(optimizer):
    cuda = torch.device("cuda")
    ebc = EmbeddingBagCollection(
        table_configs(), is_weighted=True, optimizer=optimizer, backend="triton", device=cuda
    )
    reference = Reference(ebc.to("cpu"), optimizer)
    ebc.to(cuda)
    batches, upstreams = batches_and_upstreams(seed=1, weighted=True, max_bag=12)
    for kjt, upstream in zip(batches, upstreams, strict=True):
        ebc(kjt.to(cuda)).values().backward(upstream.to(cuda))
        reference.train_step(kjt, upstream)
    assert ebc._last_backend == "triton"
    state = ebc.state_dict()
    for t, config in enumerate(reference.configs):
        torch.testing.assert_close(
            state[f"embedding_bags.{config.name}.weight"].cpu().double(),
            reference.weights[t],
            rtol=1e-5,
            atol=1e-6,
        )


def test_triton_bf16_tables_on_cuda_are_deterministic():
    cuda = torch.device("cuda")
    states = []
    for _ in range(2):
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(
            table_configs("BF16"), optimizer=RowWiseAdagrad(lr=0.1), device=cuda
        )
        batches, upstreams = batches_and_upstreams(seed=2)
        for kjt, upstream in zip(batches, upstreams, strict=True):
            ebc(kjt.to(cuda)).values().backward(upstream.to(cuda))
        states.append(ebc.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
