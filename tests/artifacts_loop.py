"""The loop of docs/artifacts.md in Python, on onnxruntime's CPU provider: what any runtime does with the files.

Used to check artifacts built for a target against the canonical ones, and the JavaScript and browser sessions
against Python on the same files."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper


def train_steps(train: onnx.ModelProto, schedule: onnx.ModelProto | None, values: Mapping[str, np.ndarray],
                loss: str, batches: Sequence[Mapping[str, np.ndarray]]) -> tuple[list[float], dict[str, np.ndarray]]:
    """The losses of one step per batch from the state ``values``, and the state after them: the schedule model
    first where there is one, each ``X.next`` output fed back as ``X``, each batch tensor cast to its input's
    type (int64 labels to the webgpu target's int32)."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(train.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    sched = (ort.InferenceSession(schedule.SerializeToString(), opts, providers=["CPUExecutionProvider"])
             if schedule is not None else None)
    types = {i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in train.graph.input}
    values = dict(values)
    names = [o.name for o in sess.get_outputs()]
    losses = []
    for batch in batches:
        feeds = dict(values)
        if sched is not None:
            outs = sched.run(None, {i.name: values[i.name] for i in sched.get_inputs()})
            feeds.update(zip([o.name for o in sched.get_outputs()], outs))
        feeds.update({k: np.asarray(v).astype(types[k]) for k, v in batch.items() if k in types})
        out = dict(zip(names, sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})))
        losses.append(float(out[loss]))
        for o, v in out.items():
            if o.endswith(".next") and o[:-5] in values:
                values[o[:-5]] = v
    return losses, values


def train_job(folder: Path, stem: str, steps: int | None = None) -> tuple[list[float], dict[str, np.ndarray]]:
    """:func:`train_steps` on the files of a job written into ``folder`` (``<stem>.train.onnx``, its schedule
    model where there is one, ``<stem>.state.safetensors``) with its batches (``<stem>.batches.safetensors``,
    tensors ``k/input``), the first ``steps`` of them where given."""
    from safetensors.numpy import load_file

    from onnxgrad.training import state

    held = state.read(folder / f"{stem}.state.safetensors")
    schedule = folder / f"{stem}.schedule.onnx"
    flat = load_file(str(folder / f"{stem}.batches.safetensors"))
    batches: list[dict[str, np.ndarray]] = [{} for _ in range(1 + max(int(k.split("/")[0]) for k in flat))]
    for key, value in flat.items():
        k, name = key.split("/")
        batches[int(k)][name] = value
    return train_steps(onnx.load(folder / f"{stem}.train.onnx"), onnx.load(schedule) if schedule.exists() else None,
                       held.tensors, held.training["loss"], batches[:steps])
