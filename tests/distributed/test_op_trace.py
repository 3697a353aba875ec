"""The dense part's op trace (recsys.distributed.op_trace) and how the step cost model charges
it: flops from torch's formulas, bytes of every argument and result, skipped modules left out
of the forward and the backward, the per-op floor."""

import numpy as np
import pytest
import torch
from torch import nn

from recsys.build.sharding import plan_inputs
from recsys.config import load_config
from recsys.distributed.op_trace import OpTrace, trace_ops
from recsys.distributed.step_cost import StepInputs, predict_step
from recsys.distributed.topology import PRESETS

META = torch.device("meta")


def _forward_backward(model: nn.Module, batch: int, input_grad: bool = False):
    x = torch.empty(batch, 16, device=META, requires_grad=input_grad)
    return lambda: model(x).sum().backward()


def test_a_linear_layer_is_three_matrix_products_of_two_flops_per_multiply_add():
    layer = nn.Linear(16, 8, device=META)
    trace = trace_ops(_forward_backward(layer, 32))
    # forward x @ W.T; backward the weight's gradient (the input needs none): 2 * 32 * 16 * 8 each
    assert trace.flops.sum() == 2 * (2 * 32 * 16 * 8)
    trace = trace_ops(_forward_backward(layer, 32, input_grad=True))
    assert trace.flops.sum() == 3 * (2 * 32 * 16 * 8)  # and the input's gradient


def test_bytes_are_every_tensor_an_op_reads_and_writes():
    a, b = torch.empty(64, 32, device=META), torch.empty(64, 32, device=META)
    trace = trace_ops(lambda: a + b)
    assert trace.ops == 1 and trace.flops.tolist() == [0.0]
    assert trace.bytes.tolist() == [3 * 64 * 32 * 4]
    view_only = trace_ops(lambda: a.view(32, 64).t())
    assert view_only.ops == 0
    # an in-place foreach op returns nothing: what it writes is its first list
    xs, ys = [torch.empty(10, device=META)] * 2, [torch.empty(10, device=META)] * 2
    foreach = trace_ops(lambda: torch._foreach_add_(xs, ys))
    assert foreach.bytes.tolist() == [(2 + 2 + 2) * 10 * 4]
    # ops of other namespaces (the profiler's marks) and allocations are no work
    with_marks = trace_ops(lambda: torch.ops.profiler._record_function_enter_new("x", None))
    assert with_marks.ops == 0 and trace_ops(lambda: a.new_empty((4, 4))).ops == 0


def test_a_skipped_module_is_left_out_of_the_forward_and_the_backward():
    first, second = nn.Linear(16, 16, device=META), nn.Linear(16, 8, device=META)
    model = nn.Sequential(first, second)
    skipped = trace_ops(_forward_backward(model, 32), skip=[first])
    assert first.weight.grad is None and second.weight.grad is not None  # never entered
    assert not first._forward_pre_hooks and not first._forward_hooks  # hooks removed
    everything = trace_ops(_forward_backward(model, 32))
    alone = trace_ops(_forward_backward(second, 32, input_grad=True))
    assert skipped.flops.sum() == alone.flops.sum() == 3 * (2 * 32 * 16 * 8)
    assert everything.flops.sum() == alone.flops.sum() + 2 * (2 * 32 * 16 * 16)


def test_a_trace_is_charged_only_at_the_batch_it_was_traced_at():
    config = load_config("configs/dlrm_synthetic.toml", ["--train.batch_size=256"])
    inputs = plan_inputs(config)
    assert inputs.dense_trace.batch_size == 256
    plan = inputs.plan(2, inputs.options(config, PRESETS["cpu_host"])[0])
    other = StepInputs(512, dense_parameters=inputs.dense_parameters,
                       dense_trace=inputs.dense_trace)  # fmt: skip
    with pytest.raises(ValueError, match="traced at 256 samples, the step has 512"):
        predict_step(plan, inputs.configs, other, PRESETS["cpu_host"])


def test_each_op_costs_at_least_the_floor():
    trace = OpTrace(np.array([0.0, 2e6, 0.0]), np.array([8.0, 0.0, 4e6]))
    # rates: 1 TFLOP/s, 1 GB/s; ops of 8 ns, 2 us and 4 ms
    assert trace.seconds(0.0, 1e12, 1e9) == pytest.approx(8e-9 + 2e-6 + 4e-3)
    assert trace.seconds(5e-6, 1e12, 1e9) == pytest.approx(5e-6 + 5e-6 + 4e-3)


def test_the_default_recipes_dense_step_is_traced_exactly():
    batch = 64
    config = load_config("configs/dlrm_synthetic.toml", [f"--train.batch_size={batch}"])
    inputs = plan_inputs(config)
    trace = inputs.dense_trace
    assert trace is not None and inputs.trace_source.startswith(f"traced on meta: {trace.ops} ops")
    layers = [(13, 64), (64, 16), (16 + 27 * 26 // 2, 128), (128, 64), (64, 1)]
    assert sum(i * o + o for i, o in layers) == inputs.dense_parameters
    # Every layer's three products, less the first one's input gradient (the dense features
    # need none); the dot interaction of 27 vectors of 16: a batched product forward, two back.
    linear = sum(3 * 2 * batch * i * o for i, o in layers) - 2 * batch * 13 * 64
    interaction = 3 * 2 * batch * 27 * 27 * 16
    assert trace.flops.sum() == linear + interaction


def test_the_traced_dense_part_replaces_six_flops_per_parameter():
    config = load_config("configs/dlrm_synthetic.toml", ["--train.batch_size=512"])
    inputs = plan_inputs(config)
    plan = inputs.plan(2, inputs.options(config, PRESETS["cpu_host"])[0])
    cpu = PRESETS["cpu_host"]
    rate, memory = cpu.dense_rate("fp32") * 1e12, cpu.memory_gbs * 1e9
    traced = StepInputs(512, dense_parameters=inputs.dense_parameters,
                        dense_trace=inputs.dense_trace)  # fmt: skip
    counted = StepInputs(512, dense_parameters=inputs.dense_parameters)
    seconds = predict_step(plan, inputs.configs, traced, cpu).seconds["dense"]
    expected = inputs.dense_trace.seconds(cpu.op_us * 1e-6, rate, memory)
    assert seconds == pytest.approx(expected)
    assert predict_step(plan, inputs.configs, counted, cpu).seconds["dense"] == pytest.approx(
        6 * inputs.dense_parameters * 512 / rate
    )
    assert seconds > 6 * inputs.dense_parameters * 512 / rate  # the interaction and the bytes


def test_a_model_that_cannot_run_on_meta_falls_back_to_counting_parameters(monkeypatch):
    import recsys.build.sharding as sharding

    def broken(*args, **kwargs):
        raise RuntimeError("no meta kernel for my_op")

    monkeypatch.setattr(sharding, "trace_ops", broken)
    inputs = plan_inputs(load_config("configs/dlrm_synthetic.toml", []))
    assert inputs.dense_trace is None
    assert inputs.trace_source == (
        "6 flops per dense parameter per sample (no meta trace: no meta kernel for my_op)"
    )
