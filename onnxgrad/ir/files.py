"""Writing files so that a crash never leaves a half-written one behind."""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Callable, Iterator

import onnx
import onnx.numpy_helper
from onnx import helper

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
    """Save a model atomically. One over protobuf's 2 GB limit keeps its large tensors in ``<path>.data``
    beside it (written first, to a temporary file renamed into place), then the model file; tensors are
    written one at a time from the model, never copied into a second proto. A model with a placeholder
    of a value held aside in memory (:data:`HELD`) is refused: its file would lack that value."""
    held = [t.name for t in model.graph.initializer if is_held(t)]
    if held:
        raise ValueError(f"onnxgrad internal error: refusing to save a model whose initializers "
                         f"{', '.join(held[:5])} are placeholders of values held in memory")
    if not over_limit(model):
        atomic_write(path, lambda f: f.write(model.SerializeToString()))
        return
    data = os.path.basename(path) + ".data"
    where: dict[str, tuple[int, int]] = {}

    def write_data(f) -> None:
        offset = 0
        for t in _large_tensors(model):
            pad = -offset % _ALIGN          # aligned, so that runtimes can map tensors in place
            f.write(b"\0" * pad)
            offset += pad
            raw = t.raw_data if t.HasField("raw_data") else onnx.numpy_helper.to_array(t).tobytes()
            f.write(raw)
            where[t.name] = (offset, len(raw))
            offset += len(raw)

    atomic_write(os.path.join(os.path.dirname(os.path.abspath(path)), data), write_data)
    small = stripped(model, lambda t: (data, *where[t.name]) if t.name in where else None)
    atomic_write(path, lambda f: f.write(small.SerializeToString()))


_ALIGN = 4096
# tensors at least this large go to the data file of a model over the limit
_EXTERNAL_THRESHOLD = 1024


def _large_tensors(model: onnx.ModelProto):
    """The main graph's initializers stored in the proto with at least _EXTERNAL_THRESHOLD bytes."""
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL and nbytes(t) >= _EXTERNAL_THRESHOLD:
            yield t


def over_limit(message) -> bool:
    """Whether protobuf refuses to serialise ``message`` (over 2 GB: upb cannot even size it)."""
    return nbytes(message) >= PROTOBUF_LIMIT


def nbytes(message) -> int:
    """message.ByteSize(), or the limit itself where protobuf cannot size it."""
    try:
        return message.ByteSize()
    except Exception:       # google.protobuf.message.EncodeError over 2 GB
        return PROTOBUF_LIMIT


def stripped(model: onnx.ModelProto, external: "Callable[[onnx.TensorProto], tuple[str, int, int] | None]"
             ) -> onnx.ModelProto:
    """A copy of ``model`` whose main-graph initializers for which ``external`` gives (location, offset,
    length) carry no data but that reference (``_DROP``: left out; ``NO_DATA``: their name, type and dims
    only); the others copied. Built field by field, so that the large tensors are never copied."""
    out = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name != "graph":
            _copy_field(out, field, value)
    for field, value in model.graph.ListFields():
        if field.name != "initializer":
            _copy_field(out.graph, field, value)
    for t in model.graph.initializer:
        ref = external(t)
        if ref is _DROP:
            continue
        if ref is NO_DATA:
            out.graph.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims, doc_string=t.doc_string,
                                      metadata_props=t.metadata_props)
            continue
        if ref is None or t.data_location == onnx.TensorProto.EXTERNAL:     # external already: as it is
            out.graph.initializer.add().CopyFrom(t)
            continue
        location, offset, length = ref
        e = out.graph.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims, doc_string=t.doc_string,
                                      metadata_props=t.metadata_props)
        e.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
            e.external_data.add(key=k, value=v)
    return out


def copy_model(model: onnx.ModelProto, skip: "set[str] | tuple" = ()) -> onnx.ModelProto:
    """A copy of ``model`` without the main-graph initializers named in ``skip``, built field by field:
    the skipped tensors are never copied (a large weight copied into a proto and deleted from it again
    stays allocated with that proto)."""
    if not skip:
        out = onnx.ModelProto()
        out.CopyFrom(model)
        return out
    return stripped(model, lambda t: _DROP if t.name in skip else None)


_DROP = ("", -1, -1)       # stripped(): leave the tensor out altogether
NO_DATA = ("", -2, -2)     # stripped(): the tensor's name, type and dims, without its data
# stripped(): a placeholder whose value someone holds aside (artifacts.build: the parameters it
# differentiates), an external reference to no file; is_held() tells it
HELD = ("onnxgrad:held-aside-in-memory", 0, 0)


def is_held(t: onnx.TensorProto) -> bool:
    return (t.data_location == onnx.TensorProto.EXTERNAL
            and any(e.key == "location" and e.value == HELD[0] for e in t.external_data))


def _copy_field(out, field, value) -> None:
    repeated = getattr(field, "is_repeated", None)       # protobuf >= 5.28; .label before
    if repeated is None:
        repeated = field.label == field.LABEL_REPEATED
    if repeated:
        getattr(out, field.name).extend(value)
    elif field.message_type is not None:
        getattr(out, field.name).CopyFrom(value)
    else:
        setattr(out, field.name, value)


@contextlib.contextmanager
def runnable(model: onnx.ModelProto, by_path: bool = False) -> Iterator["bytes | str"]:
    """What ``onnxruntime.InferenceSession`` takes for ``model``: its bytes, or the path of a copy in a temporary
    folder, removed on exit (once the session is built: onnxruntime has read or mapped it). A path for a model
    over protobuf's 2 GB limit (saved with its data beside it), and with ``by_path`` for any: onnxruntime's
    Python session keeps the bytes it was given for its life (EfficientNet-B0's training graph: 7.8 MB), a
    path costs it nothing."""
    big = over_limit(model)             # sizing walks the whole message: once
    if not by_path and not big:
        yield model.SerializeToString()
        return
    with tempfile.TemporaryDirectory(prefix="onnxgrad-") as scratch:
        path = os.path.join(scratch, "model.onnx")
        if big:
            save_model(model, path)
        else:
            with open(path, "wb") as f:
                f.write(model.SerializeToString())
        yield path


# initializers at least this large are left out of a skeleton (data_prop reads only small ones)
_SKELETON_THRESHOLD = 1 << 20


def skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """For the checker and shape inference, which serialise the model (a copy in bytes, parsed into a
    second copy, for inference serialised and parsed back) and need no large values: the model itself
    when no initializer is large or held aside (:data:`onnxgrad.ir.files.HELD`), else a copy whose large
    and held initializers are graph inputs of their type and dims. Over protobuf's 2 GB limit this is what
    makes them possible at all; below it, it keeps the weights from being copied four times over
    (ResNet-18's gradient build peaked at 7x its weights)."""
    if not any(nbytes(t) >= _SKELETON_THRESHOLD or is_held(t) for t in model.graph.initializer):
        return model
    out = stripped(model, lambda t: ("", 0, 0) if nbytes(t) >= _SKELETON_THRESHOLD else None)
    kept = [t for t in out.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    large = [t for t in out.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    inputs = {i.name for i in out.graph.input}
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    for t in large:     # declared as inputs: their type and dims, no data (the checker wants data or a file)
        if t.name not in inputs:
            out.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return out
