"""Open Inference Protocol tensors as numpy arrays, typed strictly: what the HTTP route (JSON
or the binary tensor data extension, :mod:`recsys.serve.online.http_infer`) and gRPC
(:mod:`recsys.serve.online.runtime`) hand to
:func:`~recsys.serve.online.requests.rows_from_tensors`.

An input of an integer datatype holds integers only (no float, not even ``1.0``, no bool, no
string, nothing outside the datatype's range); a floating-point one holds numbers (ints are
taken, bools and strings are not). A value that does not fit is a
:class:`~recsys.serve.online.requests.RequestError` naming the input, the element and the value.

The binary extension (Triton's ``binary_tensor_data``, as tritonclient sends by default): the
body is a JSON header of ``Inference-Header-Content-Length`` bytes, then the raw
little-endian bytes of every input whose ``parameters.binary_data_size`` says how many, in the
order of ``inputs``. The response is binary when the request asks for it
(``parameters.binary_data_output``, or ``binary_data`` on a requested output): a JSON header
whose output carries ``binary_data_size``, then the bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from recsys.serve.online.requests import RequestError

__all__ = [
    "HEADER_LENGTH",
    "Tensors",
    "binary_response",
    "decode_request",
    "json_response",
    "typed_array",
    "wants_binary_output",
]

HEADER_LENGTH = "inference-header-content-length"
"""The binary extension's HTTP header (lower case, as ASGI gives headers)."""

Tensors = dict[str, tuple[str, list[int], np.ndarray]]
"""Input name -> (datatype, shape, flat data)."""

_NUMPY = {"FP32": "<f4", "FP64": "<f8", "INT64": "<i8", "INT32": "<i4"}
_RANGES = {"INT64": (-(2**63), 2**63 - 1), "INT32": (-(2**31), 2**31 - 1)}


def typed_array(name: str, datatype: str, data: Any, bools: bool = True) -> np.ndarray:
    """The JSON ``data`` of input ``name`` (a list, possibly nested row by row) as a flat
    array of ``datatype``. ``bools``: whether ``data`` may hold a bool (False: the request's
    text has no ``true`` / ``false``, and the scan for them is skipped).

    Raises:
        RequestError: a datatype the model does not take, data that is not a list, or an
            element the datatype does not hold (named with its index).
    """
    if datatype not in _NUMPY:
        raise RequestError(
            f"input '{name}' has datatype {datatype}; this model takes FP32, FP64, INT64 or "
            "INT32 inputs"
        )
    if not isinstance(data, list):
        raise RequestError(f"input '{name}': 'data' is a {type(data).__name__}; expected a list")
    try:
        array = np.array(data)
    except (ValueError, OverflowError):  # rows of different lengths: judged element by element
        array = np.array(_flatten(data), dtype=object)
    array = array.reshape(-1)
    integer = datatype in _RANGES
    if array.size == 0:
        return np.zeros(0, _NUMPY[datatype])
    numeric = array.dtype.kind == "i" or (not integer and array.dtype.kind == "f")
    if numeric and not (bools and _holds_bool(data)):  # numpy reads true as 1 beside numbers
        if integer:
            low, high = _RANGES[datatype]
            out = (array < low) | (array > high)
            if out.any():
                i = int(np.argmax(out))
                raise RequestError(
                    f"input '{name}' element {i} is {array[i]}, outside {datatype}'s range"
                )
        return array.astype(_NUMPY[datatype])
    flat = _flatten(data)
    for i, value in enumerate(flat):
        fits = isinstance(value, int) and not isinstance(value, bool)
        if integer and fits and not _RANGES[datatype][0] <= value <= _RANGES[datatype][1]:
            raise RequestError(f"input '{name}' element {i} is {value}, outside {datatype}'s range")
        if not fits and (integer or not isinstance(value, float)):
            kind = "integers" if integer else "numbers"
            raise RequestError(
                f"input '{name}' element {i} is {json.dumps(value)}; datatype {datatype} holds "
                f"{kind}"
            )
    raise RequestError(f"input '{name}': its data does not form one {datatype} tensor")


def _holds_bool(data: list) -> bool:
    return any(type(x) is bool or (type(x) is list and _holds_bool(x)) for x in data)


def _flatten(data: Any) -> list:
    if not isinstance(data, list):
        return [data]
    if data and any(isinstance(x, list) for x in data):
        return [y for x in data for y in _flatten(x)]
    return data


def decode_request(body: bytes, header_length: int | None) -> tuple[dict, Tensors]:
    """A v2 infer request's JSON (header) and its inputs, from the whole body; with
    ``header_length`` (the binary extension's header), the inputs that carry
    ``binary_data_size`` read from the bytes after the header.

    Raises:
        RequestError: malformed JSON, a header length past the body, a missing or repeated
            input name, binary sizes that do not match the shape or the body, bytes left over.
    """
    end = len(body) if header_length is None else header_length
    if not 0 <= end <= len(body):
        raise RequestError(f"{HEADER_LENGTH} is {header_length}; the body has {len(body)} bytes")
    try:
        return _decoded(body, end, header_length, orjson.loads)
    except RequestError:  # told from json's exact reading (orjson makes 2**64 a float)
        return _decoded(body, end, header_length, json.loads)


def _decoded(
    body: bytes, end: int, header_length: int | None, loads: Callable[[bytes], Any]
) -> tuple[dict, Tensors]:
    text = body[:end]
    try:
        header = loads(text)
    except (ValueError, UnicodeDecodeError) as error:  # orjson's error is a ValueError
        raise RequestError(f"the request is not valid JSON: {error}") from None
    # numpy reads JSON's true as 1 beside numbers: without the token no value can be a bool
    bools = b"true" in text or b"false" in text
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise RequestError("the request must be an object with a list of 'inputs'")
    offset, tensors = end, {}
    for index, given in enumerate(header["inputs"]):
        if not isinstance(given, dict) or not isinstance(given.get("name"), str):
            raise RequestError(f"inputs[{index}] must be an object with a 'name'")
        name = given["name"]
        if name in tensors:
            raise RequestError(f"input '{name}' is given twice; give each input once")
        datatype, shape = given.get("datatype"), given.get("shape")
        if not isinstance(datatype, str):
            raise RequestError(f"input '{name}' has no 'datatype'")
        if not isinstance(shape, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
        ):
            raise RequestError(f"input '{name}' has shape {shape!r}; expected a list of sizes >= 0")
        size = (given.get("parameters") or {}).get("binary_data_size")
        if size is None:
            if "data" not in given:
                raise RequestError(f"input '{name}' has no 'data' (nor binary_data_size)")
            tensors[name] = (datatype, shape, typed_array(name, datatype, given["data"], bools))
            continue
        if header_length is None:
            raise RequestError(
                f"input '{name}' has binary_data_size but the request no {HEADER_LENGTH} header"
            )
        if datatype not in _NUMPY:
            raise RequestError(
                f"input '{name}' has datatype {datatype}; this model takes FP32, FP64, INT64 or "
                "INT32 inputs"
            )
        itemsize = np.dtype(_NUMPY[datatype]).itemsize
        if not isinstance(size, int) or size != math.prod(shape) * itemsize:
            raise RequestError(
                f"input '{name}' has binary_data_size {size!r}; shape {shape} of {datatype} is "
                f"{math.prod(shape) * itemsize} bytes"
            )
        if offset + size > len(body):
            raise RequestError(
                f"input '{name}' needs {size} bytes at offset {offset}; the body has {len(body)}"
            )
        array = np.frombuffer(body, _NUMPY[datatype], size // itemsize, offset).copy()
        tensors[name] = (datatype, shape, array)  # a copy: torch takes writable arrays
        offset += size
    if offset != len(body):
        raise RequestError(f"{len(body) - offset} bytes after the inputs' binary data")
    return header, tensors


def wants_binary_output(header: dict) -> bool:
    """Whether the response's outputs go as binary data (the request's
    ``parameters.binary_data_output``, or ``binary_data`` on a requested output)."""
    if (header.get("parameters") or {}).get("binary_data_output"):
        return True
    outputs = header.get("outputs") or []
    return any(
        isinstance(o, dict) and (o.get("parameters") or {}).get("binary_data") for o in outputs
    )


def _response(header: dict, model: str, scores: np.ndarray, step: int) -> dict:
    response: dict[str, Any] = {"model_name": model}
    if isinstance(header.get("id"), str):
        response["id"] = header["id"]
    response["outputs"] = [{"name": "scores", "datatype": "FP32", "shape": list(scores.shape)}]
    response["parameters"] = {"step": step}
    return response


def json_response(header: dict, model: str, scores: np.ndarray, step: int) -> bytes:
    """The v2 response with the scores as JSON data."""
    response = _response(header, model, scores, step)
    response["outputs"][0]["data"] = scores.reshape(-1).tolist()
    return json.dumps(response).encode()


def binary_response(header: dict, model: str, scores: np.ndarray, step: int) -> tuple[bytes, int]:
    """The v2 response with the scores as binary data: (body, its JSON header's length)."""
    raw = np.ascontiguousarray(scores, "<f4").tobytes()
    response = _response(header, model, scores, step)
    response["outputs"][0]["parameters"] = {"binary_data_size": len(raw)}
    head = json.dumps(response).encode()
    return head + raw, len(head)
