"""A small graph builder, so that each generator reads like the model it describes.

Ops and params created inside `scope(prefix, layer)` are named `prefix.name` and tagged with
`layer`; an op's output tensor takes the op's name. `build()` returns the validated `Graph`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator, Mapping, Sequence

from partopt.errors import InstanceError
from partopt.graph import Graph, Op, Tensor


def require_positive(model: str, **values: int) -> None:
    """Raise InstanceError unless every value is a positive integer (generator arguments)."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InstanceError(f"{name} must be a positive integer, got {value!r}", f"{model}({name}=...)",
                                f"give {name} a positive integer")


def require_divisible(model: str, what: str, value: int, divisor_name: str, divisor: int) -> None:
    """Raise InstanceError unless `divisor` divides `value` (e.g. heads must divide hidden)."""
    if value % divisor:
        raise InstanceError(f"{what} ({value}) is not divisible by {divisor_name} ({divisor})", model,
                            f"choose sizes so that {divisor_name} divides {what}")


def require_choice(model: str, name: str, value: object, choices: Sequence[str]) -> None:
    """Raise InstanceError unless `value` is one of `choices` (a generator's named options)."""
    if value not in choices:
        raise InstanceError(f"unknown {name} {value!r}", f"{model}({name}=...)", f"use one of {list(choices)}")


class GraphBuilder:
    """Collects dims, tensors and ops; hands back a validated Graph."""

    def __init__(self, name: str, dtype: str, batch_dim: str, dims: Mapping[str, int], optimizer: str = "adam"):
        self.name = name
        self.dtype = dtype
        self.optimizer = optimizer
        self.batch_dim = batch_dim
        self.dims: dict[str, int] = {}
        self.tensors: dict[str, Tensor] = {}
        self.ops: list[Op] = []
        self._prefix = ""
        self._layer: int | None = None
        for dim, size in dims.items():
            self.dim(dim, size)

    # ------------------------------------------------------------ declarations
    def dim(self, name: str, size: int) -> str:
        """Declare a dim (again, with the same size, is fine); returns its name."""
        if self.dims.setdefault(name, size) != size:
            raise InstanceError(f"dim {name!r} declared with sizes {self.dims[name]} and {size}", self.name)
        return name

    def dims_of(self, tensor: str) -> tuple[str, ...]:
        return self.tensors[tensor].dims

    def _tensor(self, name: str, dims: Sequence[str], role: str, dtype: str | None) -> str:
        if name in self.tensors:
            raise InstanceError(f"tensor {name!r} declared twice", self.name)
        self.tensors[name] = Tensor(name, tuple(dims), role, dtype)  # type: ignore[arg-type]
        return name

    def _scoped(self, name: str) -> str:
        return f"{self._prefix}.{name}" if self._prefix else name

    @contextmanager
    def scope(self, prefix: str, layer: int) -> Iterator[None]:
        """Inside, ops and params are named `prefix.<name>` and ops carry the layer tag."""
        saved = self._prefix, self._layer
        self._prefix, self._layer = prefix, layer
        try:
            yield
        finally:
            self._prefix, self._layer = saved

    def input(self, name: str, dims: Sequence[str], dtype: str | None = None) -> str:
        """A data input of the whole model (not prefixed by the scope)."""
        return self._tensor(name, dims, "input", dtype)

    def param(self, name: str, dims: Sequence[str]) -> str:
        """A trainable parameter, named inside the current scope."""
        return self._tensor(self._scoped(name), dims, "param", None)

    def op(self, kind: str, name: str, inputs: Sequence[str], dims: Sequence[str],
           dtype: str | None = None, **attrs: object) -> str:
        """Add an op whose output tensor (over `dims`) shares the op's scoped name; returns it."""
        full = self._scoped(name)
        self._tensor(full, dims, "activation", dtype)
        self.ops.append(Op(full, kind, tuple(inputs), full, self._layer, attrs))
        return full

    def linear(self, name: str, x: str, weight_dims: Sequence[str], dims: Sequence[str], bias: bool) -> str:
        """x · W (an einsum), plus a bias over W's output dims when `bias`; returns the result."""
        y = self.op("einsum", name, [x, self.param(f"{name}.w", weight_dims)], dims)
        if not bias:
            return y
        b = self.param(f"{name}.b", [d for d in dims if d in weight_dims])
        return self.op("elementwise", f"{name}.add_bias", [y, b], dims, fn="add")

    def mark_output(self, tensor: str) -> str:
        """Give `tensor` the role `output` (the model's loss or final activation)."""
        self.tensors[tensor] = replace(self.tensors[tensor], role="output")
        return tensor

    def build(self, architecture: dict[str, Any] | None = None) -> Graph:
        """The validated Graph (construction checks every rule of DESIGN §2), with the generator's `architecture`."""
        return Graph(self.name, self.dims, self.tensors, self.ops, self.batch_dim, self.dtype, self.optimizer,
                     architecture=architecture)
