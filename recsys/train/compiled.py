"""``train.compile``: the dense part of a model under ``torch.compile``.

The embedding collections stay eager: their inputs are jagged, their Triton kernels update the
tables inside backward, and under torchrun their forward is a collective. Everything else is the
dense part: each largest submodule that holds no collection (DLRM's bottom MLP, interaction and
top MLP; DCN's cross and deep networks; MMoE's experts and towers) is compiled in place with
``nn.Module.compile``, so parameter names, state dicts and checkpoints are unchanged. What the
model's own ``forward`` does between them (a view, a concatenation) stays eager.
"""

from __future__ import annotations

from torch import nn

from recsys.embedding.interface import EmbeddingCollectionInterface


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


def _holds_collection(module: nn.Module) -> bool:
    return any(isinstance(m, EmbeddingCollectionInterface) for m in module.modules())
