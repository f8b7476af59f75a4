"""Instance files: parse JSON, validate it (JSON Schema, then the IR's own rules), read and write.

Every problem with a file is an `InstanceError` whose place starts with the file name and then
the JSON path and the op (`instances/x.json: $.ops[3].inputs[1] (fc1)`), so the CLI can print it on
one line. Files are written in a fixed layout: one top-level field per line and, for graphs,
one tensor or op per line, which keeps them small and diffable.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import MISSING, dataclass, fields
from functools import cache
from importlib import resources
from os import PathLike
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import jsonschema
from jsonschema.exceptions import ValidationError, best_match

from partopt.cluster import Cluster, cluster_from_dict, cluster_to_dict
from partopt.errors import InstanceError, short
from partopt.graph import Graph, Op, Tensor

GRAPH_FORMAT = "partopt.graph"
CLUSTER_FORMAT = "partopt.cluster"
VERSION = 1

FilePath = str | PathLike[str]
_GRAPH_ROWS = ("tensors", "ops")  # graph fields written one entry per line
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_DEPTH = 64  # JSON nesting an instance or plan file may use (the formats need 6)
MAX_FILE_BYTES = 2**30  # larger files are refused before parsing (the largest corpus graph is ~2 MB)


# ---------------------------------------------------------------- places

def json_path(parts: Iterable[str | int]) -> str:
    """A JSON path such as `$.ops[3].inputs[1]` (keys that are not identifiers in brackets)."""
    text = "$"
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _IDENTIFIER.fullmatch(part):
            text += f".{part}"
        else:
            text += f"[{json.dumps(part, ensure_ascii=False)}]"
    return text


def at(where: str, place: str) -> str:
    """`place` inside the file (or object) named `where`."""
    return f"{where}: {place}" if where else place


def _named_place(data: Any, parts: list[str | int]) -> str:
    """The JSON path of `parts`, followed by the name of the innermost named list entry on it
    (`$.ops[3].inputs[1] (fc1)`, as the graph's own checks write it), so errors name the op."""
    name = None
    node = data
    for part in parts:
        node = node[part]
        if isinstance(part, int) and isinstance(node, Mapping) and isinstance(node.get("name"), str):
            name = node["name"]
    path = json_path(parts)
    return f"{path} ({name})" if name else path


# ---------------------------------------------------------------- JSON parsing

@dataclass(frozen=True)
class _DuplicateKey:
    """Stands in for a JSON object that names a key twice, so the parse can report where."""

    key: str
    first: Any
    second: Any


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict | _DuplicateKey:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            return _DuplicateKey(key, result[key], value)
        result[key] = value
    return result


def _find_duplicate(node: Any, parts: list[str | int]) -> tuple[list[str | int], _DuplicateKey] | None:
    """The first object (in document order) that names a key twice, with its path."""
    if isinstance(node, _DuplicateKey):
        return parts, node
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        found = _find_duplicate(child, [*parts, key])
        if found:
            return found
    return None


class _NonStandardConstant(ValueError):
    """NaN or ±Infinity in a file: Python's parser accepts them, JSON does not."""


def _refuse_constant(text: str) -> Any:
    raise _NonStandardConstant(text)


def _check_tree(data: Any) -> tuple[list[str | int], str, str] | None:
    """The first place (path, cause, hint) nested deeper than MAX_DEPTH or holding a string that is
    not valid Unicode (a lone surrogate such as "\\ud800" cannot be written back as UTF-8)."""
    stack: list[tuple[Any, list[str | int]]] = [(data, [])]
    while stack:
        node, parts = stack.pop()
        if len(parts) > MAX_DEPTH:
            return parts[:MAX_DEPTH], f"nested deeper than {MAX_DEPTH} levels", "partopt's formats nest a few levels"
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            for text, place in ((key, parts), (child, [*parts, key])):
                if isinstance(text, str):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        return place, f"{text!r} is not valid Unicode (a lone surrogate escape)", \
                            "use characters, or escape pairs such as \\ud83d\\ude00"
            stack.append((child, [*parts, key]))
    return None


def load_json(path: FilePath) -> dict:
    """Parse a JSON file into a dict; syntax errors, duplicate keys (a dim given two sizes, a tensor
    declared twice), NaN/Infinity, lone surrogates, deep nesting and huge files are InstanceErrors
    naming the line or the JSON path."""
    name = str(path)
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            raise InstanceError(f"the file is larger than {MAX_FILE_BYTES // 2**20} MiB", name,
                                "partopt reads instance and plan files of at most that size")
        with open(path, encoding="utf-8") as f:
            data = json.load(f, object_pairs_hook=_object_without_duplicates, parse_constant=_refuse_constant)
    except FileNotFoundError:
        raise InstanceError("no such file", name, "check the path") from None
    except json.JSONDecodeError as err:
        raise InstanceError(f"invalid JSON: {err.msg}", f"{name}: line {err.lineno} column {err.colno}",
                            "fix the JSON syntax at that place") from None
    except _NonStandardConstant as err:
        raise InstanceError(f"{err} is not a JSON number", at(name, "$"), "write finite numbers") from None
    except RecursionError:
        raise InstanceError(f"nested deeper than {MAX_DEPTH} levels", at(name, "$"),
                            "partopt's formats nest a few levels") from None
    except UnicodeDecodeError as err:
        raise InstanceError(f"not UTF-8 text ({err.reason} at byte {err.start})", name,
                            "instance files are UTF-8 JSON") from None
    except ValueError as err:  # an integer of more than 4300 digits (Python's limit on int parsing)
        raise InstanceError(f"a number is too long: {err}".split(";")[0], at(name, "$"),
                            "write numbers of sane size") from None
    except IsADirectoryError:
        raise InstanceError("is a directory, not a file", name, "give the path of a JSON file") from None
    except OSError as err:
        raise InstanceError(f"cannot read the file: {err.strerror}", name) from None
    bad = _check_tree(data)
    if bad:
        parts, cause, hint = bad
        raise InstanceError(cause, at(name, json_path(parts)), hint)
    duplicate = _find_duplicate(data, [])
    if duplicate:
        parts, dup = duplicate
        raise InstanceError(
            f"key {dup.key!r} appears twice (values {json.dumps(dup.first)} and {json.dumps(dup.second)})",
            at(name, json_path(parts)), "name each key once: a dim has one size, a tensor one declaration")
    if not isinstance(data, dict):
        raise InstanceError(f"the file holds a JSON {_json_type(data)}, not an object", at(name, "$"),
                            "an instance file is one JSON object with a \"format\" field")
    return data


# ---------------------------------------------------------------- schema validation

def _json_type(value: Any) -> str:
    """The JSON name of a Python value's type, for messages."""
    for python_type, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                              (list, "array"), (dict, "object"), (type(None), "null")):
        if isinstance(value, python_type):
            return name
    return type(value).__name__


# JSON integers only: the stock checker also accepts 3.0, which a dim size or layer tag must not be.
_STRICT_TYPES = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool))
_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=_STRICT_TYPES)


@cache
def load_schema(schema_name: str) -> dict:
    """The packaged JSON Schema `partopt/schemas/<schema_name>.schema.json` (e.g. "graph")."""
    text = resources.files("partopt").joinpath("schemas", f"{schema_name}.schema.json").read_text("utf-8")
    return json.loads(text)


def _inline_refs(node: Any, defs: Mapping[str, Any]) -> Any:
    """`node` with each `{"$ref": "#/$defs/x", ...}` replaced by definition x plus the sibling
    keywords: the same (non-recursive) schema, validated about twice as fast because nothing
    is resolved per instance node (a 1500-op graph: 0.25 s -> 0.11 s)."""
    if isinstance(node, Mapping):
        inlined = {k: _inline_refs(v, defs) for k, v in node.items() if k not in ("$ref", "$defs")}
        if "$ref" in node:
            return {**_inline_refs(defs[node["$ref"].removeprefix("#/$defs/")], defs), **inlined}
        return inlined
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


@cache
def _validator(schema_name: str) -> jsonschema.protocols.Validator:
    schema = load_schema(schema_name)
    return _Validator(_inline_refs(schema, schema.get("$defs", {})))


def _explain(error: ValidationError) -> tuple[list[str | int], str, str | None]:
    """Path, one-line cause and hint for a schema violation (jsonschema's own wording is long)."""
    parts = list(error.absolute_path)
    value, rule, schema = error.instance, error.validator_value, error.schema
    hint = schema.get("description")
    if error.validator == "additionalProperties" and isinstance(value, dict):
        allowed = list(schema.get("properties", {}))
        unknown = next(k for k in value if k not in allowed)
        return [*parts, unknown], "unknown field", f"allowed fields here: {', '.join(allowed)}"
    if error.validator == "required":
        missing = next(k for k in rule if k not in value)
        described = schema.get("properties", {}).get(missing, {}).get("description")
        return parts, f"missing required field {missing!r}", described or f"add {missing!r} (docs/FORMAT.md)"
    if error.validator == "enum":
        return parts, f"unknown value {value!r}", f"use one of: {', '.join(map(str, rule))}"
    if error.validator == "const":
        return parts, f"expected {rule!r}, got {value!r}", hint
    if error.validator == "type":
        return parts, f"expected {'/'.join(rule) if isinstance(rule, list) else rule}, got {_json_type(value)}", hint
    if error.validator == "exclusiveMinimum":
        return parts, f"must be greater than {rule}, got {short(value)}", hint
    if error.validator == "minimum":
        return parts, f"must be at least {rule}, got {short(value)}", hint
    if error.validator == "maximum":
        return parts, f"must be at most {rule}, got {short(value)}", hint
    if error.validator == "exclusiveMaximum":
        return parts, f"must be less than {rule}, got {short(value)}", hint
    if error.validator in ("minItems", "maxItems"):
        return parts, f"has {len(value)} entries, expected {'at least' if error.validator == 'minItems' else 'at most'} {rule}", hint
    if error.validator == "uniqueItems":
        return parts, "names an entry twice", hint
    return parts, error.message, hint


def _expect_format(data: Any, expected: str, where: str) -> None:
    """A file of another known kind (a cluster read as a graph) is named as such, before the
    schema would report its foreign fields one by one."""
    if isinstance(data, Mapping) and data.get("format", expected) != expected:
        raise InstanceError(f"expected {expected!r}, got {data['format']!r}", at(where, "$.format"),
                            f"this reader takes {expected} files; `partopt.io.read` takes any kind")


def validate_against_schema(data: Any, schema_name: str, where: str = "") -> None:
    """Check `data` against a packaged schema; the most relevant violation becomes an
    InstanceError at `where: <JSON path>` with a hint taken from the schema."""
    error = best_match(_validator(schema_name).iter_errors(data))
    if error is None:
        return
    parts, cause, hint = _explain(error)
    raise InstanceError(cause, at(where, _named_place(data, parts)), hint or "fix it as docs/FORMAT.md describes the field")


# ---------------------------------------------------------------- graphs

def _plain(value: Any) -> Any:
    """JSON-ready copy: tuples become lists and mappings dicts, recursively."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _default(f: Any) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else MISSING


def _without_defaults(obj: Any, names: tuple[str, ...]) -> dict:
    """The named dataclass fields of `obj` in that order, leaving out those at their default
    (canonical files omit defaults: role activation, dtype None, layer None, empty attrs)."""
    defaults = {f.name: _default(f) for f in fields(obj)}
    return {n: _plain(getattr(obj, n)) for n in names if getattr(obj, n) != defaults[n]}


def graph_to_dict(graph: Graph) -> dict:
    """The canonical file form of `graph` (DESIGN §2 key order, defaults omitted)."""
    data: dict[str, Any] = {"format": GRAPH_FORMAT, "version": VERSION, "name": graph.name, "dtype": graph.dtype}
    if graph.optimizer != "adam":
        data["optimizer"] = graph.optimizer
    if graph.matmul_dtype is not None:
        data["matmul_dtype"] = graph.matmul_dtype
    if graph.architecture is not None:
        data["architecture"] = dict(graph.architecture)
    if graph.batch_dim is not None:
        data["batch_dim"] = graph.batch_dim
    data["dims"] = dict(graph.dims)
    data["tensors"] = {name: _without_defaults(t, ("dims", "role", "dtype")) for name, t in graph.tensors.items()}
    data["ops"] = [_without_defaults(op, ("name", "kind", "inputs", "output", "layer", "attrs")) for op in graph.ops]
    return data


def graph_from_dict(data: Any, where: str = "") -> Graph:
    """Build a Graph from its file form: schema first, then the IR's rules (Graph validates
    itself); errors name `where` (the file) and the JSON path or op."""
    _expect_format(data, GRAPH_FORMAT, where)
    validate_against_schema(data, "graph", where)
    tensors = {name: Tensor(name, tuple(t["dims"]), **{k: t[k] for k in ("role", "dtype") if k in t})
               for name, t in data["tensors"].items()}
    ops = [Op(o["name"], o["kind"], tuple(o["inputs"]), o["output"], o.get("layer"), dict(o.get("attrs", {})))
           for o in data["ops"]]
    try:
        return Graph(data["name"], data["dims"], tensors, ops,
                     **{k: data[k] for k in ("batch_dim", "dtype", "optimizer", "matmul_dtype", "architecture")
                        if k in data})
    except InstanceError as err:
        raise InstanceError(err.cause, at(where, f"$.{err.where}" if err.where else "$"), err.hint) from None


# ---------------------------------------------------------------- clusters

def cluster_from_file_dict(data: Any, where: str = "") -> Cluster:
    """Build a Cluster from its file form: schema first, then the cluster's own rules."""
    _expect_format(data, CLUSTER_FORMAT, where)
    validate_against_schema(data, "cluster", where)
    try:
        return cluster_from_dict(data)
    except InstanceError as err:
        raise (err.located(where) if where else err) from None


# ---------------------------------------------------------------- files

def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def dumps(data: Mapping[str, Any], rows: tuple[str, ...] = ()) -> str:
    """Deterministic text of a file: one top-level field per line, and one entry per line for
    the fields named in `rows`; ends with a newline."""
    lines = []
    for i, (key, value) in enumerate(data.items()):
        comma = "," if i < len(data) - 1 else ""
        if key in rows and value:
            entries = ([f"{_compact(k)}: {_compact(v)}" for k, v in value.items()] if isinstance(value, Mapping)
                       else [_compact(v) for v in value])
            left, right = ("{", "}") if isinstance(value, Mapping) else ("[", "]")
            lines += [f" {_compact(key)}: {left}", ",\n".join(f"  {e}" for e in entries), f" {right}{comma}"]
        else:
            lines.append(f" {_compact(key)}: {_compact(value)}{comma}")
    return "{\n" + "\n".join(lines) + "\n}\n"


_TEMPORARY = ".partopt-"  # `write_atomic`'s temporary files: a short name in the output's directory, whatever its own


def check_output(path: FilePath) -> None:
    """Refuse, before any work, an output path whose directory is missing or refuses a new file (read-only, a
    kernel filesystem: a probe file is made there and removed), whose name is longer than its filesystem allows, or
    that is a directory itself (so a long solve never ends in an unwritable path)."""
    name = str(path)
    directory, base = os.path.split(os.path.abspath(path))
    if os.path.isdir(path):
        raise InstanceError("is a directory", name, "give a file name for the output")
    if not os.path.isdir(directory):
        raise InstanceError(f"the directory {directory} does not exist", name, "create it first or write elsewhere")
    longest = os.pathconf(directory, "PC_NAME_MAX")
    if len(os.fsencode(base)) > longest:
        raise InstanceError(f"the file name is longer than the {longest} bytes its filesystem allows", name,
                            "use a shorter name")
    try:
        fd, probe = tempfile.mkstemp(prefix=_TEMPORARY, suffix=".tmp", dir=directory)
    except OSError as err:
        raise InstanceError(f"cannot write in {directory}: {err.strerror}", name, "write elsewhere") from None
    os.close(fd)
    os.unlink(probe)


def write_atomic(path: FilePath, write: Callable[[str], None]) -> None:
    """Call `write(temporary path)` for a file in `path`'s directory, then rename it onto `path`, so a
    failure or Ctrl-C never leaves a partial file; OSError becomes an InstanceError."""
    check_output(path)
    temporary = None
    try:
        fd, temporary = tempfile.mkstemp(prefix=_TEMPORARY, suffix=".tmp", dir=os.path.dirname(os.path.abspath(path)))
        os.close(fd)
        write(temporary)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(temporary, 0o666 & ~mask)  # mkstemp's 0600 would hide the file from others
        os.replace(temporary, path)
    except OSError as err:
        raise InstanceError(f"cannot write the file: {err.strerror}", str(path),
                            "check that the directory exists and is writable") from None
    finally:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)


def write_text(text: str, path: FilePath) -> None:
    """Write UTF-8 `text` to `path` atomically (see `write_atomic`); text that cannot be encoded (a lone
    surrogate from a command-line name) is refused before anything is written."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InstanceError(f"the text holds {err.object[err.start:err.end]!r}, which is not valid Unicode", str(path),
                            "use names made of characters") from None
    write_atomic(path, lambda temporary: Path(temporary).write_bytes(data))


def write_json(data: Mapping[str, Any], path: FilePath, rows: tuple[str, ...] = ()) -> None:
    """Write `data` in the layout of `dumps`, atomically; an unwritable path is an InstanceError."""
    write_text(dumps(data, rows), path)


def read_graph(path: FilePath) -> Graph:
    """Load and validate a graph file."""
    return graph_from_dict(load_json(path), str(path))


def write_graph(graph: Graph, path: FilePath) -> None:
    """Write `graph` canonically, one tensor and one op per line."""
    write_json(graph_to_dict(graph), path, _GRAPH_ROWS)


def read_cluster(path: FilePath) -> Cluster:
    """Load and validate a cluster file."""
    return cluster_from_file_dict(load_json(path), str(path))


def write_cluster(cluster: Cluster, path: FilePath) -> None:
    """Write `cluster` canonically."""
    write_json(cluster_to_dict(cluster), path)


_READERS: dict[str, Callable[[Any, str], Graph | Cluster]] = {
    GRAPH_FORMAT: graph_from_dict,
    CLUSTER_FORMAT: cluster_from_file_dict,
}


def read(path: FilePath) -> Graph | Cluster:
    """Load a graph or cluster file, whichever its "format" field names."""
    data = load_json(path)
    name = str(path)
    if "format" not in data:
        raise InstanceError("missing required field 'format'", at(name, "$"),
                            f"set \"format\" to one of: {', '.join(_READERS)}")
    reader = _READERS.get(data["format"]) if isinstance(data["format"], str) else None
    if reader is None:
        raise InstanceError(f"unknown format {data['format']!r}", at(name, "$.format"),
                            f"use one of: {', '.join(_READERS)}")
    return reader(data, name)
