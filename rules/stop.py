"""Ops whose derivative is zero or undefined: gradients stop at them, silently.

An entry here documents that the op was considered (it is not "unsupported")
and lets backward graphs that use these ops (Sign in Abs's rule, Greater in
Relu's, Shape and Equal in unbroadcasting) be differentiated again. Most of
these ops' schemas tag their inputs NonDifferentiable anyway; where a schema
says Differentiable or says nothing, ``why`` gives the reason the derivative
is still zero.
"""
from __future__ import annotations

from .registry import register_stop

# Piecewise-constant float functions (schema: NonDifferentiable).
register_stop("Floor", "Ceil", "Round", "Sign",
              why="piecewise constant: the derivative is zero almost everywhere", zero_derivative=True)

# Tagged Differentiable by the schema, but piecewise constant in its input.
register_stop("Hardmax",
              why="a one-hot of the argmax: piecewise constant in the input, so the derivative is "
                  "zero almost everywhere (undefined at ties)", zero_derivative=True)

# Integer- or bool-valued results (schema: NonDifferentiable).
register_stop("ArgMax", "ArgMin", "NonZero",
              why="integer indices")
register_stop("IsNaN", "IsInf",
              why="boolean result")
register_stop("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual",
              why="comparison: boolean result")
register_stop("Not", "And", "Or", "Xor",
              why="logical op on booleans")
register_stop("BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot",
              why="bitwise op on integers")

# Results that depend on a tensor's shape only, or on nothing at all.
register_stop("Shape", "Size",
              why="depends only on the input's shape")
register_stop("Constant",
              why="no inputs")
register_stop("ConstantOfShape", "EyeLike",
              why="the values depend only on a shape (schema: untagged)")
register_stop("HannWindow", "HammingWindow", "BlackmanWindow", "MelWeightMatrix",
              why="a window or filter bank computed from integer sizes and fixed parameters")
register_stop("OneHot",
              why="the schema tags every input NonDifferentiable (indices and depth are integers; "
                  "the on/off values are treated as constants)")

# Random sampling: the result is a draw, not a differentiable function of the inputs.
register_stop("RandomNormal", "RandomUniform",
              why="random draw with no inputs")
register_stop("RandomNormalLike", "RandomUniformLike",
              why="random draw; the input only gives the shape (schema: untagged)")
register_stop("Bernoulli", "Multinomial",
              why="discrete random draw: piecewise constant in the probabilities (schema: untagged)")
