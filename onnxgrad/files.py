"""Writing files so that a crash never leaves a half-written one behind."""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import onnx
import onnx.external_data_helper

# protobuf refuses to serialise a message over 2 GB: bigger models keep their tensors beside them
PROTOBUF_LIMIT = 2_000_000_000


def atomic_write(path: str, write: Callable[[Any], None]) -> None:
    """Write via a temporary file in the same folder, fsync it, and rename it over ``path``.

    The file gets the permissions a plain ``open`` would give it (0666 less the umask).
    Temporary files that an earlier writer left behind when it was killed mid-write
    (their process is gone) are removed first.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    prefix = f".{os.path.basename(path)}."
    _remove_stale_temporaries(folder, prefix)
    fd, tmp = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _remove_stale_temporaries(folder: str, prefix: str) -> None:
    """Delete ``<prefix><pid>.*.tmp`` files whose writing process no longer exists."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        pid = name[len(prefix):].split(".", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(folder, name))
        except OSError:
            pass


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True           # another thread of this process may be writing it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:           # exists, owned by someone else
        return True
    return True


def save_model(model: onnx.ModelProto, path: str) -> None:
    """Save a model atomically. One over protobuf's 2 GB limit keeps its tensors in ``<path>.data``,
    written first (to a temporary file renamed into place), then the model file."""
    if model.ByteSize() < PROTOBUF_LIMIT:
        atomic_write(path, lambda f: f.write(model.SerializeToString()))
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    data = os.path.basename(path) + ".data"
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".onnxgrad-") as scratch:
        onnx.external_data_helper.convert_model_to_external_data(
            copy, all_tensors_to_one_file=True, location=data, size_threshold=0)
        onnx.external_data_helper.write_external_data_tensors(copy, scratch)
        os.replace(os.path.join(scratch, data), os.path.join(folder, data))
    atomic_write(path, lambda f: f.write(copy.SerializeToString()))


def save_arrays(arrays: "dict[str, Any]", path: str) -> None:
    """Save named arrays as an ``.npz`` file (numpy.load reads it), atomically."""
    import numpy as np

    atomic_write(path, lambda f: np.savez(f, **{k: np.asarray(v) for k, v in arrays.items()}))
