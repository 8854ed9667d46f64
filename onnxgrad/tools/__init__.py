"""What users and tests run on top of everything else.

- :mod:`.cli`: ``python -m onnxgrad`` (gradients, jvp, params, ops, lower, training artifacts).
- :mod:`.check`: the numeric check, gradient graphs against float64 central differences.
- :mod:`.coverage`: which ai.onnx ops have a rule, and onnx's backend cases for each.
- :mod:`.lowering`: ``ai.onnx.preview.training`` ops lowered to standard ops.
"""
