"""The built-in recipes by name (recipes.py parses them): plain data, so the command line lists
them without importing torch."""

BUILTIN = {
    "int8": "*: int8",
    "int4-g32": "*: int4-g32",
    "int4-g64": "*: int4-g64",
    "int4-g128": "*: int4-g128",
    "int4-g32-asym": "*: int4-g32-asym",
    "int4-g64-asym": "*: int4-g64-asym",
    "int4-g128-asym": "*: int4-g128-asym",
    # The embedding / tied head at 8 bits (every logit passes through it; measured as the most
    # sensitive weight), asymmetric 4-bit elsewhere. See docs/quantization.md.
    "mixed": "embed: int8; *: int4-g32-asym",
    "mixed-small": "embed: int8; *: int4-g64-asym",
    # also v/down at 8 bits (as llama.cpp's Q4_K_M keeps them wider): for sensitive models (Gemma 3)
    "mixed-quality": "embed: int8; v_proj,down_proj: int8; *: int4-g32-asym",
}
