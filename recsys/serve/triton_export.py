"""``recsys export --format triton DIR``: a Triton Inference Server model repository holding the
export as an AOTInductor package, for Triton's PyTorch backend (``platform: "torch_aoti"``,
Triton 26.03 and later)::

    DIR/<name>/config.pbtxt     backend "pytorch", platform "torch_aoti", the inputs and
                                output with the program's dtypes and dims (-1: dynamic)
    DIR/<name>/1/model.pt2      torch._inductor.aoti_compile_and_package of the program that
                                ``recsys export`` writes (trained weights inside)

Inputs and outputs are named by position (``INPUT__0`` ... and ``OUTPUT__0``, the PyTorch
backend's ordinal names): for a CTR model ``INPUT__0`` dense f32[B, N_dense], ``INPUT__1``
values int64[L] (key-major), ``INPUT__2`` lengths int64[F * B], ``OUTPUT__0`` probabilities
f32[B, T] (see :mod:`recsys.serve.export`); a sequence model's inputs are its top-K program's
(:mod:`recsys.serve.retrieval_export`). ``max_batch_size`` is 0: the batch is the first dim of
each tensor, as the program takes it (the backend does not batch AOTInductor models yet).

The package runs on the device it was compiled for (``device``: "cpu" here, "cuda" on a GPU
machine for a GPU server). A model with tiered tables is refused: Triton would have to look their
rows up outside the program (serve it with ``recsys serve``). Deltas do not reach a Triton
repository: export a later checkpoint as a new repository (or version directory).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch
from torch.export.passes import move_to_device_pass  # a submodule torch.export does not import

from recsys.checkpoint.io import read_spec, resolve_checkpoint
from recsys.serve.export import export_model
from recsys.serve.tiered_export import TIERED_FILE

__all__ = ["TRITON_DTYPES", "export_triton", "triton_config"]

TRITON_DTYPES = {
    torch.float32: "TYPE_FP32",
    torch.float16: "TYPE_FP16",
    torch.bfloat16: "TYPE_BF16",
    torch.float64: "TYPE_FP64",
    torch.int64: "TYPE_INT64",
    torch.int32: "TYPE_INT32",
    torch.bool: "TYPE_BOOL",
}
"""torch dtypes -> Triton's model config data types."""


def export_triton(
    checkpoint: str | Path,
    directory: str | Path,
    *,
    name: str = "recsys",
    device: str = "cpu",
    overwrite: bool = False,
) -> Path:
    """Write a Triton model repository for a checkpoint's model (see the module docstring).

    Args:
        checkpoint: a checkpoint directory, or a run directory (its newest checkpoint).
        directory: the model repository (created if missing); the model goes to
            ``directory/name``, which appears only once complete.
        name: the model's name in Triton (``/v2/models/<name>``).
        device: "cpu" or "cuda": where the compiled package runs.
        overwrite: replace ``directory/name`` when it exists (else that is an error).

    Returns:
        ``directory/name``.

    Raises:
        ValueError: ``directory/name`` exists without ``overwrite``; a bad ``name`` or
            ``device``; a model with tiered tables.

    Example::

        export_triton("runs/dlrm_synthetic", "triton_models")
        # tritonserver --model-repository=triton_models
    """
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"--name {name!r}: expected a model name (no '/', not starting '.')")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: expected 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "--device cuda compiles the package for this machine's GPU, and torch sees none "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'not built'}): export on a "
            "machine with a GPU, or --device cpu"
        )
    checkpoint = resolve_checkpoint(checkpoint)
    target = Path(directory) / name
    if target.exists() and not overwrite:
        raise ValueError(f"'{target}' exists; pass --overwrite to replace it")
    created = not target.parent.exists()
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=target.parent))
    try:
        program = _program(checkpoint, work / "export.pt2")
        if device == "cuda":
            program = move_to_device_pass(program, "cuda")
        (work / "model" / "1").mkdir(parents=True)
        config = triton_config(program, name, device)
        spec = read_spec(checkpoint)
        arguments = ", ".join(
            f"INPUT__{i} {argument}"
            for i, argument in enumerate(program.graph_signature.user_inputs)
        )
        header = (
            f"# recsys export of {checkpoint}\n"
            f"# {arguments} (the program's arguments: see recsys.serve.export, or for a sequence\n"
            "# model recsys.serve.retrieval_export / ranking_export)\n"
            f"# dense features {list(spec.dense_names)}\n"
            f"# categorical features {list(spec.sparse_names)}\n"
            f"# tasks {list(spec.label_names)}\n"
        )
        (work / "model" / "config.pbtxt").write_text(header + config)
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(work / "model" / "1" / "model.pt2")
        )
        if target.exists():
            os.replace(target, work / "replaced")
        os.replace(work / "model", target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if created and not any(target.parent.iterdir()):  # a failed export leaves no folder
            target.parent.rmdir()
    return target


def _program(checkpoint: Path, path: Path) -> torch.export.ExportedProgram:
    """The program ``recsys export`` writes for ``checkpoint``, written to ``path`` and read back
    (what ``recsys predict`` scores with)."""
    export_model(checkpoint, path)
    with zipfile.ZipFile(path) as archive:
        tiered = any(n.endswith(f"/extra/{TIERED_FILE}") for n in archive.namelist())
    if tiered:
        raise ValueError(
            f"'{checkpoint}' has tables in the host or disk tier, which are looked up outside "
            "the exported program (through a cache): Triton cannot serve them; serve it with "
            "`recsys serve --model ... --cache-rows N`, or train with model.storage.tier = "
            "'device' for a Triton export"
        )
    return torch.export.load(path)


def triton_config(program: torch.export.ExportedProgram, name: str, device: str = "cpu") -> str:
    """The ``config.pbtxt`` of ``program`` for Triton's PyTorch backend (AOTInductor): its user
    inputs and outputs by position, with their dtypes and dims (-1 where dynamic)."""
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    inputs = [placeholders[n].meta["val"] for n in program.graph_signature.user_inputs]
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    user_outputs = set(program.graph_signature.user_outputs)
    outputs = [a.meta["val"] for a in output_node.args[0] if a.name in user_outputs]
    lines = [
        f'name: "{name}"',
        'backend: "pytorch"',
        'platform: "torch_aoti"',
        "max_batch_size: 0",
        "input [",
        ",\n".join(_tensor(f"INPUT__{i}", t) for i, t in enumerate(inputs)),
        "]",
        "output [",
        ",\n".join(_tensor(f"OUTPUT__{i}", t) for i, t in enumerate(outputs)),
        "]",
        f"instance_group [ {{ kind: {'KIND_GPU' if device == 'cuda' else 'KIND_CPU'} }} ]",
    ]
    return "\n".join(lines) + "\n"


def _tensor(name: str, value: torch.Tensor) -> str:
    if value.dtype not in TRITON_DTYPES:
        raise ValueError(f"tensor '{name}' has dtype {value.dtype}, which Triton cannot take")
    dims = ", ".join(str(d) if isinstance(d, int) else "-1" for d in value.shape)
    return (
        f'  {{\n    name: "{name}"\n    data_type: {TRITON_DTYPES[value.dtype]}\n'
        f"    dims: [ {dims} ]\n  }}"
    )
