"""The passes: graphs in, graphs out, built from the rules (:mod:`onnxgrad.rules`) on the IR.

- :mod:`.autodiff`: the reverse pass, :func:`onnxgrad.grad`; :mod:`.record` reads what it records.
- :mod:`.forward`: forward mode, :func:`onnxgrad.jvp`; :mod:`.tangent_fallback`: a tangent from the reverse
  rule's transpose; :mod:`.funcs`: the torch.func family (jacrev, jacfwd, hessian, hvp).
- :mod:`.reach`: what a pass differentiates (:class:`~.reach.Objective`), each node's rule and
  differentiable inputs, the tensors a gradient reaches; :mod:`.function_body`: the rule of an op without
  one, through its ONNX function body.
- :mod:`.params`: which initializers are trainable parameters (grad's default ``wrt``, what training trains).
- :mod:`.recompute` and :mod:`.optimize`: rewrites of a gradient graph (recomputed activations; a
  runtime's faster forms, CPU and CUDA).
"""
