"""Frontends: turn the programs of real frameworks into partopt graphs.

`partopt.frontends.jax` walks a jaxpr, `partopt.frontends.onnx` an ONNX model and
`partopt.frontends.torch` a `torch.export` program (docs/FRONTENDS.md says what maps to what). Each
imports its framework itself, lazily: importing this package imports none.
"""
