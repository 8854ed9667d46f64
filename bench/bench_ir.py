"""What one shared parsed model would cost the passes: onnx-ir (onnxscript's IR) against plain protobuf.

On bench_build.py's synthetic chain (``h = Tanh(MatMul(h, W_i) + b_i) * c_i`` on 4x4 tensors, ending in a
ReduceSum loss; opset 17, ir_version 8) it times, per size:

- ``proto copy``: ``SerializeToString`` + ``ModelProto.FromString``, a yardstick (a copy of the model);
- ``ir deserialize`` / ``ir serialize``: ``onnx_ir.serde.deserialize_model`` (ModelProto -> ``onnx_ir.Model``)
  and ``serialize_model`` (back); ``ir producer/uses``: a walk over every value of the IR model (inputs,
  initializers, node outputs) reading ``value.producer()`` and ``value.uses()`` into two dicts;
  ``ir round trip``: the three together, timed as one;
- ``proto producer/consumers``: one pass over ``graph.node`` building output name -> node and
  name -> [(node, input index)], the same maps from the proto;
- ``proto infer_shapes``: ``onnx.shape_inference.infer_shapes`` once; ``proto read value_info``: the inferred
  graph's inputs, outputs and ``value_info`` read into name -> (elem_type, dims);
- ``ir deserialize inferred`` / ``ir read type+shape``: the inferred model deserialized, and every value's
  ``.type`` and ``.shape`` read into the same dict.

Each step: one warm-up, then the median of 5 ``time.perf_counter`` runs, in ms. 100k nodes is added when the
slowest 10k step predicts under ~20 s a run there (or name the sizes).

    .venv/bin/python bench/bench_ir.py                 # 1k, 10k (100k when fast enough)
    .venv/bin/python bench/bench_ir.py 1000 10000      # some sizes

A benchmark, not a test: it prints times and asserts nothing about them.
"""
from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time

import onnx
import onnx_ir

RUNS = 5


def _load_chain():
    """bench_build.chain, loaded by path (bench/ is not a package): both benchmarks build the same chain."""
    spec = importlib.util.spec_from_file_location(
        "bench_build", os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.chain


# --- the steps ---------------------------------------------------------------------------------------------

def proto_copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.ModelProto.FromString(proto.SerializeToString())


def _ir_values(graph: onnx_ir.Graph):
    yield from graph.inputs
    yield from graph.initializers.values()
    for node in graph:
        yield from node.outputs


def ir_producers_uses(model: onnx_ir.Model) -> tuple[dict, dict]:
    producer, uses = {}, {}
    for v in _ir_values(model.graph):
        producer[v.name] = v.producer()
        uses[v.name] = list(v.uses())
    return producer, uses


def ir_round_trip(proto: onnx.ModelProto) -> onnx.ModelProto:
    model = onnx_ir.serde.deserialize_model(proto)
    ir_producers_uses(model)
    return onnx_ir.serde.serialize_model(model)


def proto_producers_consumers(proto: onnx.ModelProto) -> tuple[dict, dict]:
    producer, consumers = {}, {}
    for node in proto.graph.node:
        for j, name in enumerate(node.input):
            if name:
                consumers.setdefault(name, []).append((node, j))
        for name in node.output:
            if name:
                producer[name] = node
    return producer, consumers


def proto_read_value_info(inferred: onnx.ModelProto) -> dict:
    g = inferred.graph
    out = {}
    for vi_list in (g.input, g.output, g.value_info):
        for vi in vi_list:
            t = vi.type.tensor_type
            dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim) \
                if t.HasField("shape") else None
            out[vi.name] = (t.elem_type, dims)
    return out


def ir_read_type_shape(model: onnx_ir.Model) -> dict:
    out = {}
    for v in _ir_values(model.graph):
        shape = v.shape
        out[v.name] = (v.type, tuple(shape) if shape is not None else None)
    return out


# --- timing ------------------------------------------------------------------------------------------------

def timed(fn, *args) -> float:
    """Median of RUNS calls after one warm-up, in s."""
    fn(*args)
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(chain, n: int) -> tuple[dict, str]:
    proto = chain(n)
    model = onnx_ir.serde.deserialize_model(proto)
    inferred = onnx.shape_inference.infer_shapes(proto)
    model_inf = onnx_ir.serde.deserialize_model(inferred)
    r = {
        "proto copy (Serialize+FromString)": timed(proto_copy, proto),
        "ir deserialize_model": timed(onnx_ir.serde.deserialize_model, proto),
        "ir serialize_model": timed(onnx_ir.serde.serialize_model, model),
        "ir producer()/uses() of every value": timed(ir_producers_uses, model),
        "ir round trip (deser+walk+ser)": timed(ir_round_trip, proto),
        "proto producer/consumer dicts": timed(proto_producers_consumers, proto),
        "proto infer_shapes": timed(onnx.shape_inference.infer_shapes, proto),
        "proto read value_info": timed(proto_read_value_info, inferred),
        "proto infer + dicts + value_info": timed(
            lambda p: (proto_producers_consumers(p), proto_read_value_info(onnx.shape_inference.infer_shapes(p))),
            proto),
        "ir deserialize inferred model": timed(onnx_ir.serde.deserialize_model, inferred),
        "ir read .type/.shape of every value": timed(ir_read_type_shape, model_inf),
    }
    # What each side found (a check that both walks see the same graph, not a timing).
    prod, cons = proto_producers_consumers(proto)
    iprod, iuses = ir_producers_uses(model)
    shapes_proto = sum(d is not None for _, d in proto_read_value_info(inferred).values())
    shapes_ir = sum(s is not None for _, s in ir_read_type_shape(model_inf).values())
    note = (f"{n}: {len(proto.graph.node)} nodes, {len(proto.graph.initializer)} initializers; "
            f"producers proto {len(prod)} / ir {sum(p is not None for p in iprod.values())}, "
            f"uses proto {sum(map(len, cons.values()))} / ir {sum(map(len, iuses.values()))}; "
            f"values with a shape: proto {shapes_proto} / ir {shapes_ir} (initializers too)")
    return r, note


def main(argv: list[str]) -> None:
    chain = _load_chain()
    sizes = [int(a) for a in argv] or [1000, 10000]
    auto_100k = not argv
    print(f"onnx {onnx.__version__}, onnx_ir {onnx_ir.__version__}, python {sys.version.split()[0]}; "
          f"median of {RUNS} runs after a warm-up, ms")
    results, notes = {}, []
    for n in sizes:
        results[n], note = measure(chain, n)
        notes.append(note)
    if auto_100k and max(results[10000].values()) * 10 < 20:
        results[100000], note = measure(chain, 100000)
        notes.append(note)
        sizes.append(100000)
    steps = list(results[sizes[0]])
    width = max(map(len, steps))
    heads = [f"{n // 1000}k" if n % 1000 == 0 else str(n) for n in sizes]
    print(f"{'step':<{width}}  " + "  ".join(f"{h:>9}" for h in heads))
    for s in steps:
        print(f"{s:<{width}}  " + "  ".join(f"{results[n][s] * 1e3:9.1f}" for n in sizes))
    for note in notes:
        print(note)


if __name__ == "__main__":
    main(sys.argv[1:])
