"""The state file of a training job: every state tensor, by the training model's input names, in safetensors.

One format for the initial state the command line writes, for :class:`onnxgrad.TrainingSession`'s checkpoints
and for the JavaScript session's, so a checkpoint moves between Python, Node and the browser (docs/artifacts.md
is the contract). The tensors: parameters, running statistics, optimizer state (as the graph holds it),
accumulators of a half-done window, ``lr`` and ``step`` (the number of the next update), each in the dtype of
the training model's input it feeds. The
metadata: ``format``, ``version``, ``training`` (the :class:`~onnxgrad.training.artifacts.TrainingSpec`, JSON),
``model_sha256`` (what model it trains) and, from a Python session, ``session`` (its counters and options,
JSON); a Python checkpoint also carries its model as the uint8 tensor ``onnxgrad.model``.

The files written before this format (``TrainingSession.save``'s zip of ``.npy`` arrays, versions 1 and 2) are
still read: :func:`read` returns them in the same shape.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np
import onnx

from ..errors import OnnxGradError
from ..ir.files import NO_DATA, atomic_write, stripped

__all__ = ["State", "read", "write", "fingerprint", "CheckpointError", "CorruptCheckpointError",
           "CheckpointMismatchError", "FORMAT", "VERSION", "MODEL_TENSOR", "LR", "STEP"]

FORMAT = "onnxgrad-state"
VERSION = "1"
MODEL_TENSOR = "onnxgrad.model"     # a Python checkpoint's model (uint8): TrainingSession.load needs no other file
LR, STEP = "lr", "step"             # 0-d, in the types of the training model's inputs (float32; int64 or int32)

_ZIP_FORMAT = "onnxgrad-checkpoint"     # TrainingSession.save before the state file (zip of .npy arrays)
_ZIP_VERSIONS = (1, 2)                  # 1: PyTorch's state values; 2: as the graph holds them ("state_scale")


class CheckpointError(OnnxGradError):
    """A checkpoint cannot be used."""


class CorruptCheckpointError(CheckpointError):
    """The file is not a readable onnxgrad checkpoint (truncated, damaged, or another format)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint belongs to another model, parameter set or optimizer than this session's."""


@dataclass
class State:
    """A state file's tensors (by the training model's input names) and metadata (strings)."""

    tensors: dict[str, np.ndarray]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def training(self) -> dict[str, Any]:
        """The training spec it was written with (a dict of :class:`TrainingSpec`'s fields; {} when absent)."""
        return json.loads(self.metadata.get("training", "{}"))

    @property
    def session(self) -> dict[str, Any]:
        """A Python session's counters and options ({} for a file the command line or JavaScript wrote)."""
        return json.loads(self.metadata.get("session", "{}"))

    @property
    def model(self) -> bytes | None:
        """The serialized model a Python checkpoint carries, else None."""
        m = self.tensors.get(MODEL_TENSOR)
        return None if m is None else m.tobytes()


def fingerprint(loss_model: onnx.ModelProto, trained: Iterable[str]) -> str:
    """What model a state file trains: the SHA-256 of the loss model without the data of the ``trained``
    tensors (its graph and frozen weights), so that the CLI, the session and a checkpoint agree."""
    held = set(trained)
    return hashlib.sha256(stripped(loss_model, lambda t: NO_DATA if t.name in held else None)
                          .SerializeToString()).hexdigest()


def write(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write a state file atomically (a temporary file renamed over ``path``: a crash leaves the old one).

    The tensors are laid out widest type first (each stays aligned to its element size), and the metadata's
    ``sha256`` is the digest of that data, so that a damaged file is refused when read (safetensors itself has
    no checksum). Written array by array: no copy of the state is made in memory."""
    arrays = sorted(((name, np.asarray(v, order="C")) for name, v in tensors.items()),     # 0-d stays 0-d
                    key=lambda item: (-item[1].dtype.itemsize, item[0]))
    digest = hashlib.sha256()
    header: dict[str, Any] = {}
    offset = 0
    for name, a in arrays:
        if a.dtype.str[1:] not in _SAFETENSORS_DTYPE:
            raise CheckpointError(f"cannot write '{name}' ({a.dtype}) to a state file: safetensors holds "
                                  f"{', '.join(sorted(set(_SAFETENSORS_DTYPE.values())))}")
        header[name] = {"dtype": _SAFETENSORS_DTYPE[a.dtype.str[1:]], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        digest.update(_little_endian(a).data)
    header["__metadata__"] = {"format": FORMAT, "version": VERSION, **metadata, "sha256": digest.hexdigest()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)             # the data starts 8-byte aligned

    def put(f) -> None:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for _, a in arrays:
            f.write(_little_endian(a).data)

    atomic_write(os.fspath(path), put)


# numpy's dtype.str without its byte order -> the safetensors name
_SAFETENSORS_DTYPE = {"f8": "F64", "f4": "F32", "f2": "F16", "i8": "I64", "i4": "I32", "i2": "I16", "i1": "I8",
                      "u8": "U64", "u4": "U32", "u2": "U16", "u1": "U8", "b1": "BOOL"}


def _little_endian(a: np.ndarray) -> np.ndarray:
    return a if a.dtype.byteorder != ">" else a.astype(a.dtype.newbyteorder("<"))


def read(path: str | os.PathLike) -> State:
    """Read a state file (or a checkpoint of the earlier zip format); :class:`CorruptCheckpointError` names
    what is wrong with a file that is not one."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at '{path}'")
    if zipfile.is_zipfile(path):
        return _read_zip(path)
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "numpy") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise CorruptCheckpointError(f"cannot read checkpoint '{path}': it is not a safetensors file "
                                     f"({type(e).__name__}: {e})") from None
    if metadata.get("format") != FORMAT:
        raise CorruptCheckpointError(f"'{path}' is a safetensors file but not an onnxgrad state file "
                                     f"(its metadata has no format '{FORMAT}')")
    if metadata.get("version") != VERSION:
        raise CorruptCheckpointError(f"'{path}' is an onnxgrad state file of version {metadata.get('version')}; "
                                     f"this onnxgrad reads version {VERSION}")
    if "sha256" in metadata and _data_digest(path) != metadata["sha256"]:
        raise CorruptCheckpointError(f"checkpoint '{path}' is damaged: its tensors do not match their checksum")
    for key in ("training", "session"):
        try:
            json.loads(metadata.get(key, "{}"))
        except ValueError:
            raise CorruptCheckpointError(f"'{path}': its '{key}' metadata is not JSON") from None
    return State(tensors, metadata)


def _data_digest(path: str) -> str:
    """The SHA-256 of a safetensors file's data (what follows its header), read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(8 + int.from_bytes(f.read(8), "little"))
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_zip(path: str) -> State:
    """A checkpoint of the zip format (``header.json``, ``model.onnx``, ``arrays/<k>.npy``), as a State: its
    arrays under the training model's input names, its header as the ``session`` metadata."""
    try:
        with zipfile.ZipFile(path) as z:
            header = json.loads(z.read("header.json"))
            if header.get("format") != _ZIP_FORMAT:
                raise CorruptCheckpointError(f"'{path}' is not an onnxgrad checkpoint")
            if header.get("version") not in _ZIP_VERSIONS:
                raise CorruptCheckpointError(f"checkpoint '{path}' has format version {header.get('version')}; "
                                             f"this onnxgrad reads versions {', '.join(map(str, _ZIP_VERSIONS))}")
            model_bytes = z.read("model.onnx")
            if hashlib.sha256(model_bytes).hexdigest() != header.get("model_sha256"):
                raise CorruptCheckpointError(f"checkpoint '{path}': its model does not match its checksum")
            tensors: dict[str, np.ndarray] = {MODEL_TENSOR: np.frombuffer(model_bytes, np.uint8)}
            state: dict[str, dict[str, list[str]]] = {}
            params: dict[str, str] = {}
            buffers: dict[str, list[str]] = {}
            for k, meta in enumerate(header["arrays"]):
                a = np.lib.format.read_array(io.BytesIO(z.read(f"arrays/{k}.npy")), allow_pickle=False)
                if list(a.shape) != list(meta["shape"]) or a.dtype.str != meta["dtype"]:
                    raise CorruptCheckpointError(f"checkpoint '{path}': array {k} does not match its header")
                if meta["kind"] == "param":
                    name = meta["name"]
                    params[name] = ""
                elif meta["kind"] == "buffer":
                    name = meta["name"]
                    buffers[name] = [name, ""]
                elif meta["kind"] == "state":      # the graphs name a state input <param>.<state>
                    name = f"{meta['param']}.{meta['state']}"
                    state.setdefault(meta["param"], {})[meta["state"]] = [name, ""]
                else:
                    name = f"{meta['param']}.grad_acc"
                tensors[name] = a
    except CheckpointError:
        raise
    except Exception as e:  # zipfile, json, numpy: a damaged or foreign file
        raise CorruptCheckpointError(f"cannot read checkpoint '{path}': {type(e).__name__}: {e}") from None
    tensors[LR] = np.array(header["lr"], np.float32)
    tensors[STEP] = np.array(int(header["step_count"]) + 1, np.int64)
    # version 1 held PyTorch's values: no scale
    scale = header.get("state_scale", {}) if header["version"] >= 2 else {}
    training = {"optimizer": header["optimizer"], "params": params, "buffers": buffers, "state": state,
                "state_scale": scale, "accumulation_steps": header["accumulation_steps"]}
    metadata = {"format": FORMAT, "version": VERSION, "training": json.dumps(training),
                "model_sha256": header["model_sha256"], "session": json.dumps(header)}
    if header.get("micro"):
        metadata["accumulated"] = str(header["micro"])
    return State(tensors, metadata)
