"""What users and tests run on top of everything else.

- :mod:`.cli`: ``python -m onnxgrad`` (gradients, jvp, params, ops, lower, training artifacts).
- :mod:`.check`: the numeric check, gradient graphs against float64 central differences.
- :mod:`.compare`: ``compare_with_torch``, onnxgrad's training against PyTorch float32 and float64.
- :mod:`.coverage`: which ai.onnx ops have a rule, and onnx's backend cases for each.
- :mod:`.lowering`: ``ai.onnx.preview.training`` ops lowered to standard ops.
"""
