"""A compiled package's model called through the AOTInductor runtime's C interface, with the GIL
released while it runs.

torch's loader for an AOTInductor package (``torch._inductor.aoti_load_package``) runs the model
while holding the GIL: in ``recsys serve`` the event loop thread, which parses requests and
answers them, then stands still for as long as a batch scores, and the two threads take turns
where they could run side by side. The package's shared library exports a C interface
(``torch/csrc/inductor/aoti_runtime/interface.h``: create a model container, run it, read its
call spec), the one torch's loader calls itself. :class:`AotiLibrary` loads that library with
:mod:`ctypes`, which releases the GIL for the length of every foreign call, and converts tensors
to and from the runtime's tensor handles with the helpers torch's own generated wrappers use
(``torch._C._aoti``).

It takes the packages ``aoti_compile_and_package`` writes for a CPU program with its weights
inside the library (the default; ``recsys serve --compile aoti``'s). :meth:`AotiLibrary.load`
returns ``None`` for any other layout (weights beside the library, custom ops run through a
proxy executor, several models, another device): the caller then uses torch's loader.
"""

from __future__ import annotations

import _ctypes
import ctypes
import json
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["AotiLibrary"]

_MODEL_DIRECTORY = "data/aotinductor/model"
# What a package with its weights in the library holds there besides the library: the
# generated sources and their metadata (a proxy executor's extern-kernel ``.json`` is not one).
_SOURCES = (".cpp", "_metadata.json")

# Python's capsule functions, with signatures of their own (not set on ctypes.pythonapi's
# shared function objects): torch._C._aoti's tensor handles are unnamed capsules.
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)
_new_capsule = ctypes.PYFUNCTYPE(
    ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p
)(("PyCapsule_New", ctypes.pythonapi))

_Handles = ctypes.POINTER(ctypes.c_void_p)


class AotiLibrary:
    """The model of one package, callable as ``library(*tensors)`` like torch's loaded package
    (positional tensor inputs; outputs in the program's output structure). Deleting it deletes
    its container and unloads the library.

    Use :meth:`load`.
    """

    def __init__(self, library_path: Path) -> None:
        self._handle = None
        self._library = ctypes.CDLL(str(library_path))
        self._handle = self._library._handle
        library = self._library
        library.AOTInductorModelContainerRun.argtypes = [
            *(ctypes.c_void_p, _Handles, ctypes.c_size_t, _Handles, ctypes.c_size_t),
            *(ctypes.c_void_p, ctypes.c_void_p),
        ]
        self._container = ctypes.c_void_p()
        self._check(
            library.AOTInductorModelContainerCreateWithDevice(
                ctypes.byref(self._container), ctypes.c_size_t(1), b"cpu", None
            ),
            "create the model container",
        )
        count = ctypes.c_size_t()
        self._check(
            library.AOTInductorModelContainerGetNumInputs(self._container, ctypes.byref(count)),
            "read the number of inputs",
        )
        self.num_inputs = count.value
        self._check(
            library.AOTInductorModelContainerGetNumOutputs(self._container, ctypes.byref(count)),
            "read the number of outputs",
        )
        self.num_outputs = count.value
        inputs_spec, outputs_spec = ctypes.c_char_p(), ctypes.c_char_p()
        self._check(
            library.AOTInductorModelContainerGetCallSpec(
                self._container, ctypes.byref(inputs_spec), ctypes.byref(outputs_spec)
            ),
            "read the call spec",
        )
        self._outputs_spec = pytree.treespec_loads(outputs_spec.value.decode())

    @classmethod
    def load(cls, package: Path) -> AotiLibrary | None:
        """The package's model, or ``None`` when the package is not the one layout this class
        takes (see the module docstring)."""
        with zipfile.ZipFile(package) as archive:
            names = archive.namelist()
            libraries, others = [], []
            for name in names:
                parts = PurePosixPath(name).parts
                inside = parts[1:]  # below the package's top directory
                if inside[:1] != ("data",):
                    continue
                directory = "/".join(inside[:-1])
                if directory == _MODEL_DIRECTORY and name.endswith(".so"):
                    libraries.append(name)
                elif directory != _MODEL_DIRECTORY or not name.endswith(_SOURCES):
                    others.append(name)
            if len(libraries) != 1 or others:
                return None
            metadata = [n for n in names if n.endswith(".wrapper_metadata.json")]
            if metadata:
                device = json.loads(archive.read(metadata[0])).get("AOTI_DEVICE_KEY", "cpu")
                if device != "cpu":
                    return None
            with tempfile.TemporaryDirectory(prefix="recsys-aoti-") as work:
                path = Path(work) / "model.so"
                path.write_bytes(archive.read(libraries[0]))
                return cls(path)  # loaded: the file can go, the mapping stays

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != self.num_inputs:
            raise TypeError(
                f"the compiled program takes {self.num_inputs} tensors, not {len(inputs)}"
            )
        # New at::Tensor handles, which the run takes over (torch's generated wrappers' helpers).
        given = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(list(inputs))
        handles = (ctypes.c_void_p * self.num_inputs)(*(_capsule_pointer(c, None) for c in given))
        outputs = (ctypes.c_void_p * self.num_outputs)()
        # A foreign call through ctypes.CDLL: the GIL is released until it returns.
        error = self._library.AOTInductorModelContainerRun(
            self._container, handles, self.num_inputs, outputs, self.num_outputs, None, None
        )
        if error:
            raise RuntimeError(
                f"the compiled program failed (AOTInductor runtime error {error}; its message "
                "is on the server's stderr)"
            )
        tensors = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
            [_new_capsule(pointer, None, None) for pointer in outputs]
        )
        return pytree.tree_unflatten(tensors, self._outputs_spec)

    def __del__(self) -> None:
        if self._handle is None or sys.is_finalizing():  # at exit the process unmaps it all
            return
        container = getattr(self, "_container", None)
        if container is not None and container.value:
            self._library.AOTInductorModelContainerDelete(container)
        _ctypes.dlclose(self._handle)
        self._handle = None

    def _check(self, error: int, what: str) -> None:
        if error:
            raise RuntimeError(f"AOTInductor's runtime could not {what} (error {error})")
