"""The ctypes signatures Python calls the kernels with, checked against the C definitions: an
argument added, dropped or retyped on one side only would pass garbage without a word."""
from __future__ import annotations

import ctypes
import re
from importlib import resources

import pytest

from edgellm.kernels.build import _SIGNATURES, SOURCES

# an exported definition: `type name(params) {` at the start of a line (static helpers are not exported)
DEFINITION = re.compile(r"^(?!static)([A-Za-z_][\w \*]*?)\b(edgellm_\w+)\s*\(([^)]*)\)\s*\{", re.M)
SCALARS = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double}


def _ctype(declaration: str):
    """The ctypes type a C parameter or return type passes as (every pointer as c_void_p)."""
    declaration = re.sub(r"\bconst\b|\brestrict\b", " ", declaration).strip()
    if "*" in declaration:
        return ctypes.c_void_p
    words = declaration.split()
    if words[:1] == ["void"]:
        return None
    if words and words[0] == "LayerFn":  # a function pointer typedef
        return ctypes.c_void_p
    return SCALARS[words[0]]


def c_definitions() -> dict[str, tuple]:
    """edgellm_* function -> (return ctype, [parameter ctypes]) from every C source the library builds."""
    found = {}
    for name in SOURCES:
        if not name.endswith(".c"):
            continue
        text = resources.files("edgellm.kernels").joinpath(name).read_text()
        text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
        for returns, function, params in DEFINITION.findall(text):
            params = [p for p in (s.strip() for s in params.split(",")) if p and p != "void"]
            found[function] = (_ctype(returns.replace("ALWAYS_INLINE", "")), [_ctype(p.rsplit(None, 1)[0] if "*" not in p
                                                                                     else p[:p.rindex("*") + 1]) for p in params])
    return found


@pytest.fixture(scope="module")
def definitions():
    return c_definitions()


@pytest.mark.parametrize("function", sorted(_SIGNATURES))
def test_each_python_signature_matches_its_c_definition(definitions, function):
    assert function in definitions, f"{function} is typed in build.py but defined in no C source"
    assert _SIGNATURES[function] == definitions[function]


def test_the_parser_reads_a_known_definition(definitions):
    """A guard on the test itself: a definition spread over lines, with pointers and scalars."""
    assert definitions["edgellm_affine_rows_to_float"] == (
        ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p])
    assert len(definitions) >= len(_SIGNATURES)


def c_structs(header: str = "layer_types.h") -> dict[str, list[tuple[str, str]]]:
    """typedef'd structs of a header: name -> [(field, C type)] in order, arrays as `type[N]`."""
    text = re.sub(r"/\*.*?\*/", " ", resources.files("edgellm.kernels").joinpath(header).read_text(), flags=re.S)
    found = {}
    for body, name in re.findall(r"typedef struct \{(.*?)\}\s*(\w+);", text, re.S):
        fields = []
        for declaration in (d.strip() for d in body.split(";") if d.strip()):
            kind, _, names = re.match(r"((?:const )?\w+)\s+(.*)", declaration).group(1, 1, 2)
            for declarator in names.split(","):
                declarator = declarator.strip()
                pointer = declarator.startswith("*")
                field, _, count = declarator.lstrip("*").partition("[")
                fields.append((field, kind.replace("const ", "") + ("*" if pointer else "") + (f"[{count}" if count else "")))
        found[name] = fields
    return found


def test_each_ctypes_struct_matches_its_c_typedef():
    """Field names and order, pointers against pointers, 64-bit integers against int64_t, floats
    against float, nested structs by name: models/native/structs.py against layer_types.h."""
    import ctypes

    from edgellm.models.native import structs

    scalar = {"int64_t": ctypes.c_int64, "float": ctypes.c_float}
    typedefs = c_structs()
    assert {"WeightPart", "Projection", "KVStore", "KVPage", "KVSlots", "LayerDims", "LlamaLayer", "GemmaLayer",
            "LoraPair", "LoraLayer"} <= set(typedefs)
    for name, fields in typedefs.items():
        ours = getattr(structs, name)._fields_
        assert [f for f, _ in ours] == [f for f, _ in fields], name
        for (field, kind), (_, c_kind) in zip(ours, fields):
            if c_kind.endswith("*"):
                assert kind is ctypes.c_void_p, (name, field)
            elif "[" in c_kind:
                assert issubclass(kind, ctypes.Array) and kind._type_.__name__ == c_kind.split("[")[0], (name, field)
            elif c_kind in scalar:
                assert kind is scalar[c_kind], (name, field)
            else:
                assert kind.__name__ == c_kind, (name, field)
