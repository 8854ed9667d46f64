import sys, numpy as np, onnx, onnxruntime as ort
from onnxgrad.backend_cases import all_cases, _integers_as_constants, _inputs, _differentiable_inputs, _differentiable_outputs
from onnxgrad.model import load
import onnxgrad
name = sys.argv[1]
c = [c for c in all_cases() if c.name == name][0]
model = load(c.model)
wrt = _differentiable_inputs(c, model); of = _differentiable_outputs(c, model)
feeds = _inputs(c, model, wrt, np.random.default_rng(0))
model = _integers_as_constants(model, feeds)
gm = onnxgrad.grad(model, wrt=wrt, of=of, allow_unused=True)
from onnx import printer
if '-p' in sys.argv: print(printer.to_text(gm))
onnx.checker.check_model(gm, full_check=True)
s = ort.InferenceSession(gm.SerializeToString(), providers=["CPUExecutionProvider"])
print("loaded")
from onnxgrad.check import gradient_spec
spec = gradient_spec(gm)
fw = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
outs = dict(zip([o.name for o in model.graph.output], fw.run(None, {k: v for k, v in feeds.items() if k in {i.name for i in model.graph.input}})))
gf = {k: v for k, v in feeds.items() if k in {i.name for i in gm.graph.input}}
for o, sd in spec["seeds"].items(): gf[sd] = np.ones_like(outs[o])
r = s.run(None, gf)
for o, v in zip([o.name for o in gm.graph.output], r): print(o, v.shape, v.ravel()[:6])
