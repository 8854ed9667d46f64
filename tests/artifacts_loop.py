"""The loop of docs/artifacts.md in Python, on onnxruntime's CPU provider: what any runtime does with the files.

Used to check artifacts built for a target against the canonical ones, and the JavaScript and browser sessions
against Python on the same files."""
from __future__ import annotations

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
