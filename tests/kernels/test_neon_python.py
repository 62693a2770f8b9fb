"""The stronger ARM check: edgellm itself, in an aarch64 Python under `qemu-aarch64 -cpu max`, loads
SmolLM2 and decodes on the NEON kernels (cross-compiled by the host's gcc-aarch64-linux-gnu when the
library is first built). The aarch64 Python with torch comes from `tools/arm64-root.sh` (~1.3 GB;
`make test` makes it where it can); without it this test skips and says how to make it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import edgellm

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


@pytest.mark.slow
def test_smollm2_decodes_on_the_neon_kernels_in_an_aarch64_python(smollm2_path, tmp_path):
    python = ROOT / "usr/bin/python3.11"
    missing = [tool for tool in ("qemu-aarch64", "aarch64-linux-gnu-gcc") if shutil.which(tool) is None]
    if missing or not (ROOT / "opt/site/torch").is_dir():
        pytest.skip(f"needs {', '.join(missing) or 'an aarch64 root'}: make arm-tools, then tools/arm64-root.sh")
    env = dict(os.environ, CC=shutil.which("aarch64-linux-gnu-gcc"), EDGELLM_CACHE=str(tmp_path),
               PYTHONPATH=f"/opt/site:{REPO / 'src'}")
    env.pop("EDGELLM_ISA", None)
    done = subprocess.run(["qemu-aarch64", "-cpu", "max", "-L", str(ROOT), str(python), "-c", SCRIPT, str(smollm2_path)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    arm = json.loads(done.stdout.strip().splitlines()[-1])
    assert arm["variant"].startswith("neon") and arm["native"] and arm["fused"]
    model = edgellm.load(smollm2_path)
    try:
        assert arm["ids"] == list(model.generate(PROMPT, max_tokens=TOKENS, temperature=0).token_ids)
    finally:
        model.close()
