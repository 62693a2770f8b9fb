"""The stronger ARM check: edgellm itself, in an aarch64 Python under `qemu-aarch64 -cpu max`, loads
SmolLM2 and decodes on the NEON kernels (cross-compiled by the host's gcc-aarch64-linux-gnu when the
library is first built), and the int8 prompt GEMM there gives the AVX2 build's floats. The aarch64 Python with torch comes from `tools/arm64-root.sh` (~1.3 GB;
`make test` makes it where it can); without it this test skips and says how to make it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import edgellm
from tests.kernels.test_int8_prompt import needs_avx2

REPO = Path(__file__).resolve().parents[2]
ROOT = Path(os.environ.get("EDGELLM_ARM64_ROOT", REPO / ".arm64root"))
PROMPT, TOKENS = "The capital of France is", 4  # top-2 logit gaps 2.5, 1.3, 1.4, 1.3 on x86: no near-tie

SCRIPT = f"""
import json, edgellm
from edgellm.kernels import isa
from edgellm.kernels.build import library
model = edgellm.load(__import__("sys").argv[1])
done = model.generate({PROMPT!r}, max_tokens={TOKENS}, temperature=0)
print(json.dumps(dict(variant=isa.selected().label, native=library() is not None,
                      fused=model.net.decoder is not None, ids=list(done.token_ids))))
"""


@pytest.fixture(scope="module")
def arm_cache(tmp_path_factory) -> Path:
    """One cache for the module's aarch64 runs: the NEON library is cross-compiled once (~10 s)."""
    return tmp_path_factory.mktemp("arm-cache")


def _arm_python(script: str, *args: str, cache: Path) -> str:
    """Run `script` with `args` in the aarch64 Python under qemu (edgellm's kernels cross-compiled into
    `cache`); its stdout. Skips, saying how to get them, where the tools or the aarch64 root are missing."""
    python = ROOT / "usr/bin/python3.11"
    missing = [tool for tool in ("qemu-aarch64", "aarch64-linux-gnu-gcc") if shutil.which(tool) is None]
    if missing or not (ROOT / "opt/site/torch").is_dir():
        pytest.skip(f"needs {', '.join(missing) or 'an aarch64 root'}: make arm-tools, then tools/arm64-root.sh")
    env = dict(os.environ, CC=shutil.which("aarch64-linux-gnu-gcc"), EDGELLM_CACHE=str(cache),
               PYTHONPATH=f"/opt/site:{REPO / 'src'}")
    env.pop("EDGELLM_ISA", None)
    done = subprocess.run(["qemu-aarch64", "-cpu", "max", "-L", str(ROOT), str(python), "-c", script, *args],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_smollm2_decodes_on_the_neon_kernels_in_an_aarch64_python(smollm2_path, arm_cache):
    arm = json.loads(_arm_python(SCRIPT, str(smollm2_path), cache=arm_cache).strip().splitlines()[-1])
    assert arm["variant"].startswith("neon") and arm["native"] and arm["fused"]
    model = edgellm.load(smollm2_path)
    try:
        assert arm["ids"] == list(model.generate(PROMPT, max_tokens=TOKENS, temperature=0).token_ids)
    finally:
        model.close()


INT8_SCRIPT = """
import sys, torch
from edgellm.kernels.build import library_for
from edgellm.kernels.int8_prompt import Int8Prompt
from edgellm.kernels.isa import Variant
lib = library_for(Variant("neon"))
inputs = torch.load(sys.argv[1])
out = {}
for name, (x, weight) in inputs.items():
    product = Int8Prompt(x, lib)
    if name == "i4r64":
        out[name] = product.times_i4r64(weight[0], weight[1], (0, weight[0].shape[0]))
    else:
        out[name] = getattr(product, "times_" + name)(weight)
    out[name + "/parts"] = torch.cat([getattr(Int8Prompt(x[a:b], lib), "times_" + name)(*(
        (weight[0], weight[1], (0, weight[0].shape[0])) if name == "i4r64" else (weight,))) for a, b in ((0, 3), (3, 11))])
torch.save(out, sys.argv[2])
print("ok", bool(lib.edgellm_int8_gemm_native()))
"""


@pytest.mark.slow
@needs_avx2
def test_the_int8_prompt_gemm_on_neon_gives_avx2s_floats_under_qemu(tmp_path, arm_cache):
    """int8_gemm.c's NEON build (sdot on the weights' own codes, the activations' outliers in fp32), run
    in the aarch64 Python under qemu on I4R64, widened Q5_0 and Q6_K weights: the same floats, bit for
    bit, as the AVX2 build on this machine (the same integers and float operations per lane), whole
    and in two calls of the same tokens."""
    from edgellm import kernels
    from edgellm.kernels.int8_prompt import Int8Prompt

    from tests.kernels.test_int8_prompt import AVX2, _activations, _i4r64, _q5_0_in_q8r16, _q6_k

    gen = torch.Generator().manual_seed(21)
    packed, pairs, _ = _i4r64(128, 640, gen)
    x = _activations(11, 640, gen)
    x[4, 33] = 700.0  # an outlier of one token's own
    inputs = {"i4r64": (x, (packed, pairs)), "q5_0": (x, _q5_0_in_q8r16(48, 640, gen)[0]),
              "q6_k": (_activations(11, 768, gen), _q6_k(32, 768)[0])}
    torch.save(inputs, tmp_path / "inputs.pt")
    out = _arm_python(INT8_SCRIPT, str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt"), cache=arm_cache)
    assert out.split()[-2:] == ["ok", "True"]
    neon, lib = torch.load(tmp_path / "outputs.pt"), kernels.library_for(AVX2)
    avx2 = {"i4r64": Int8Prompt(x, lib).times_i4r64(packed, pairs, (0, 128)),
            "q5_0": Int8Prompt(x, lib).times_q5_0(inputs["q5_0"][1]),
            "q6_k": Int8Prompt(inputs["q6_k"][0], lib).times_q6_k(inputs["q6_k"][1])}
    for name, expected in avx2.items():
        assert torch.equal(neon[name], expected), name
        assert torch.equal(neon[name + "/parts"], expected), name  # a token's row whatever shares its call


PROMPT_SCRIPT = """
import sys, torch, edgellm
from edgellm import kernels
model = edgellm.load(sys.argv[1])
ids = model.tokenizer.encode(sys.argv[3])
torch.save(dict(describe=kernels.describe(), ids=ids, logits=model.logits(ids)[-1]), sys.argv[2])
"""
# 60 tokens; next " water" by 3.8 logits over the runner-up (fp32 reference): no near-tie
LONG_PROMPT = " ".join(["The harbour light turns over the water, slow and patient, every night of the year."] * 3) \
    + " The harbour light turns over the"


@pytest.mark.slow
@needs_avx2
def test_smollm2s_prompt_path_on_neon_multiplies_in_int8_as_avx2_does(smollm2_path, tmp_path, arm_cache):
    """A prompt past the native pieces' 32 tokens goes through the prompt path, whose linears take
    the int8 GEMM on NEON without bf16 (as on x86 without it): its last logits in the aarch64 Python
    under qemu are as close to the fp32 reference (exact mode) as the AVX2 build's on this machine
    (max |difference| ~1.1 % of the largest logit; AVX2 and AVX-512 differ from each other by as
    much: the norms and attention sum in other orders, and an activation can round to another code)."""
    from edgellm import kernels
    from edgellm.kernels import build, isa

    _arm_python(PROMPT_SCRIPT, str(smollm2_path), str(tmp_path / "arm.pt"), LONG_PROMPT, cache=arm_cache)
    arm = torch.load(tmp_path / "arm.pt")
    assert arm["describe"].startswith("neon") and "int8 prompt GEMMs" in arm["describe"] and len(arm["ids"]) > 32
    isa.selected.cache_clear()
    build.library.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as mp:  # restores a variant the whole run was given
            mp.setenv("EDGELLM_ISA", "avx2")
            with edgellm.load(smollm2_path) as model:
                assert "int8 prompt GEMMs" in kernels.describe()
                x86 = model.logits(arm["ids"])[-1]
    finally:
        isa.selected.cache_clear()
        build.library.cache_clear()
    with edgellm.load(smollm2_path, mode="exact") as model:
        reference = model.logits(arm["ids"])[-1]
    scale = reference.abs().max()
    off = {name: float((logits - reference).abs().max() / scale) for name, logits in (("neon", arm["logits"]), ("avx2", x86))}
    print(f"\nmax |difference| from the fp32 reference, of its largest logit: {off}")
    assert off["neon"] < 2e-2 and off["avx2"] < 2e-2
    assert int(arm["logits"].argmax()) == int(reference.argmax())  # " water", 3.8 logits ahead
