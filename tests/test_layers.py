"""The package's layers: every import of an edgellm module goes down a layer or stays inside its
own top-level entry, and no modules import each other round in a cycle — at module level or inside
functions alike (an import inside a function hides a cycle; it does not remove it).
docs/architecture.md draws the same layers."""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import edgellm

ROOT = Path(edgellm.__file__).parent

# bottom to top: an entry may import entries of its own layer or of the layers below
LAYERS = [
    ["errors", "extras", "atomic", "threads", "module", "registry", "memory"],
    ["families"],  # one module per model family: names, conventions, quirks (no arithmetic)
    ["kernels"],  # the C kernels and their bindings
    ["quant"],  # weight formats, quantized linears
    ["io"],  # file readers: GGUF, safetensors, Hugging Face folders, the pack cache
    ["store"],  # the local model store: blobs, manifests, pulls; what a --model names
    ["tokenizer"],  # and chat/: templates, messages, tool-call formats
    ["kv"],
    ["lora"],
    ["models"],  # the runners of the families, their layers, the native runner (models/native)
    ["generation"],  # passes over the KV, the loop, sampling, speculative decoding, constrain/
    ["api"],  # what an app imports: load, Model, tasks, the planner
    ["tools"],  # quantize, convert, evaluate
    ["serving"],  # service, scheduler, engine, handles, sessions, thermal, profiles
    ["entrypoints", "__main__", "__init__"],  # cli/, http/, bench/; the package itself re-exports the api lazily
]
RANK = {entry: i for i, layer in enumerate(LAYERS) for entry in layer}


def module_name(path: Path) -> str:
    return ".".join(("edgellm", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def entry(module: str) -> str:
    """The top-level entry a module belongs to ("__init__" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(module: str) -> Iterator[tuple[str, int]]:
    """The edgellm modules `module` imports anywhere in its text, with the line: `from a.b import c`
    counts as importing a.b.c where that is a module, else a.b."""
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("edgellm"):
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                yield (target if target in MODULES else node.module), node.lineno
        elif isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if a.name in MODULES)


GRAPH = {m: {t for t, _ in imports(m) if t != m and t in MODULES} for m in MODULES}


def test_every_top_level_entry_has_a_layer():
    assert {entry(m) for m in MODULES} <= set(RANK), sorted({entry(m) for m in MODULES} - set(RANK))


def test_no_import_goes_up_a_layer():
    upward = [f"{m}:{line} imports {t}" for m in sorted(MODULES) for t, line in imports(m)
              if t in MODULES and RANK[entry(t)] > RANK[entry(m)]]
    assert not upward, upward


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root), on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child), on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_modules_import_each_other_in_a_cycle():
    assert not cycles(GRAPH), cycles(GRAPH)


def test_the_checks_see_a_cycle_and_an_upward_import():
    """A guard on the checks themselves."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert RANK[entry("edgellm.kernels.gemv")] < RANK[entry("edgellm.models.native.decoder")]
    assert "edgellm.kernels.limits" in GRAPH["edgellm.serving.scheduler"]
