"""``train.compile``: the dense part of a model under ``torch.compile``.

The embedding collections stay eager: their inputs are jagged, their Triton kernels update the
tables inside backward, and under torchrun their forward is a collective. Everything else is the
dense part: each largest submodule that holds no collection (DLRM's bottom MLP, interaction and
top MLP; DCN's cross and deep networks; MMoE's experts and towers) is compiled in place with
``nn.Module.compile``, so parameter names, state dicts and checkpoints are unchanged. What the
model's own ``forward`` does between them (a view, a concatenation) stays eager.

``train.cuda_graphs`` compiles the same modules in torch.compile's mode ``"reduce-overhead"``:
inductor records each compiled forward and backward as a CUDA graph (CUDA graph trees) and
replays it, one launch for the module's kernels. The train step tells the graphs where a step
begins (``torch.compiler.cudagraph_mark_step_begin``) and drops the gradients (``set_to_none``)
before each backward, as graph replays require. On a CPU the mode compiles without graphs.
"""

from __future__ import annotations

import torch
from torch import nn

from recsys.embedding.interface import EmbeddingCollectionInterface

CUDA_GRAPHS_MODE = "reduce-overhead"


def dense_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The largest submodules of ``model`` that hold no embedding collection, by path, in
    module order."""
    found: dict[str, nn.Module] = {}

    def visit(module: nn.Module, path: str) -> None:
        for name, child in module.named_children():
            where = f"{path}.{name}" if path else name
            if isinstance(child, EmbeddingCollectionInterface):
                continue
            if _holds_collection(child) or type(child).forward is nn.Module.forward:
                visit(child, where)  # or a container (ModuleList, ModuleDict): never called
            else:
                found[where] = child

    visit(model, "")
    return found


def compile_dense(model: nn.Module, **options) -> list[str]:
    """Compile the :func:`dense_modules` of ``model`` in place (``torch.compile`` with
    ``options``); the paths compiled."""
    modules = dense_modules(model)
    for module in modules.values():
        module.compile(**options)
    return list(modules)


def compile_options(cuda_graphs: bool) -> dict[str, str]:
    """The ``torch.compile`` options of the dense part: mode ``"reduce-overhead"`` (CUDA
    graphs) under ``train.cuda_graphs``, the defaults otherwise."""
    return {"mode": CUDA_GRAPHS_MODE} if cuda_graphs else {}


def compile_line(paths: list[str], cuda_graphs: bool, device: torch.device) -> str:
    """What a run prints about the dense part it compiled (``paths``) on ``device``."""
    line = f"torch.compile: {', '.join(paths) if paths else 'no dense module'}"
    if not cuda_graphs:
        return line
    if device.type == "cuda":
        return line + f' (mode "{CUDA_GRAPHS_MODE}": forward and backward replayed as CUDA graphs)'
    return line + (
        f' (mode "{CUDA_GRAPHS_MODE}"); train.cuda_graphs: no CUDA device ({device.type}), '
        "so the dense part runs compiled, without CUDA graphs"
    )


def _holds_collection(module: nn.Module) -> bool:
    return any(isinstance(m, EmbeddingCollectionInterface) for m in module.modules())
