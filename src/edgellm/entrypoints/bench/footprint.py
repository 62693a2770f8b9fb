"""`edgellm bench --footprint`: what a user meets before any speed — the installed size of an
engine's runtime, its import time, and a whole `run` process (start, load, 16 tokens answered,
exit): wall time and peak RSS. edgellm beside llama-cpp-python on the same GGUF, same prompt.

The installed size is the engine's distribution and every distribution it requires, without
extras (what `pip install edgellm` brings), summed over the files each one lists as installed;
the model packages are not counted. Each process is a fresh interpreter; medians over `repeat`."""
from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import importlib.util
from importlib import metadata

from edgellm.entrypoints.bench.runner import llama_cpp_available
from edgellm.store import resolve

PROMPT = "The lighthouse at the end of the harbour had been automated for thirty years, but"
TOKENS = 16
_LLAMA_RUN = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[4]), verbose=False)
done = llm.create_completion(sys.argv[2], max_tokens=int(sys.argv[3]), temperature=0.0)
print(done["choices"][0]["text"])
"""


def _requirement_names(dist: metadata.Distribution) -> list[str]:
    """The distributions `dist` requires for its plain install: no extras, markers of this machine."""
    names = []
    for line in dist.requires or []:
        name, _, marker = line.partition(";")
        if marker and not _marker_holds(marker):
            continue  # an extra's, or another platform's
        names.append(re.match(r"[A-Za-z0-9._-]+", name.strip()).group(0))
    return names


def _marker_holds(marker: str) -> bool:
    if "extra" in marker:
        return False
    try:
        from packaging.markers import Marker
    except ImportError:  # without packaging, a platform marker counts as met
        return True
    return Marker(marker).evaluate()


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_sizes(root: str) -> dict[str, float]:
    """MB installed per distribution of `root`'s runtime closure (root included)."""
    sizes: dict[str, float] = {}
    todo = [root]
    while todo:
        name = _normalized(todo.pop())
        if name in sizes:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # required but absent: nothing installed to count
        sizes[name] = (sum(_file_bytes(dist, f) for f in dist.files or []) + _editable_bytes(dist)) / 1e6
        todo += _requirement_names(dist)
    return sizes


def _editable_bytes(dist: metadata.Distribution) -> int:
    """An editable install lists only its .pth file: the size of its package folder instead."""
    files = [str(f) for f in dist.files or []]
    if not any(f.startswith("__editable__") and f.endswith(".pth") for f in files) \
            or any(f.endswith(".py") for f in files):
        return 0
    spec = importlib.util.find_spec(_normalized(dist.metadata["Name"]).replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        return 0
    return sum(os.path.getsize(os.path.join(folder, name)) for root in spec.submodule_search_locations
               for folder, _, names in os.walk(root) if "__pycache__" not in folder for name in names)


def _file_bytes(dist: metadata.Distribution, file) -> int:
    try:
        return os.path.getsize(dist.locate_file(file))
    except OSError:
        return 0


def import_seconds(module: str, repeat: int) -> float:
    """Median seconds of `import module` in a fresh interpreter (the interpreter's own start excluded)."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    return statistics.median(float(_python(["-c", code]).strip()) for _ in range(repeat))


def _python(args: list[str]) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{args[:2]} failed: {done.stderr.strip()[-500:]}")
    return done.stdout


def whole_process(command: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MB) of one process run to its end."""
    with tempfile.TemporaryFile() as errors:  # not a pipe: a chatty child would fill it and wait
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            errors.seek(0)
            raise RuntimeError(f"{command[:3]} failed: {errors.read().decode(errors='replace')[-500:]}")
    return wall, usage.ru_maxrss / 1024  # KB on Linux


def _run_command(engine: str, model: str, threads: int) -> list[str]:
    if engine == "llama.cpp":
        return [sys.executable, "-c", _LLAMA_RUN, str(resolve(model)), PROMPT, str(TOKENS), str(threads)]
    return [sys.executable, "-m", "edgellm", "run", PROMPT, "--raw", "-q", "-m", model, "-n", str(TOKENS),
            "--threads", str(threads)]


def footprint_report(models: list[str], threads: int, repeat: int = 3, llama_cpp: bool = True,
                     progress=print) -> dict:
    engines = {"edgellm": ("edgellm", "edgellm")}
    if llama_cpp and llama_cpp_available():
        engines["llama.cpp"] = ("llama-cpp-python", "llama_cpp")
    report: dict = dict(threads=threads, repeat=repeat, tokens=TOKENS, engines={}, runs=[])
    for engine, (dist, module) in engines.items():
        progress(f"{engine}: installed size, import time ...")
        sizes = installed_sizes(dist)
        report["engines"][engine] = dict(installed_mb=sum(sizes.values()), by_distribution=sizes,
                                         import_s=import_seconds(module, repeat))
    for model in models:
        entry: dict = dict(model=model, engines={})
        for engine in engines:
            progress(f"{model} · {engine}: {repeat} whole runs of {TOKENS} tokens ...")
            runs = [whole_process(_run_command(engine, model, threads)) for _ in range(repeat)]
            entry["engines"][engine] = dict(wall_s=statistics.median(w for w, _ in runs),
                                            peak_rss_mb=statistics.median(r for _, r in runs),
                                            wall_s_runs=[w for w, _ in runs], peak_rss_mb_runs=[r for _, r in runs])
        report["runs"].append(entry)
    return report


def format_footprint(report: dict) -> str:
    lines = [f"{'engine':<11}{'installed MB':>13}{'import s':>10}  largest distributions"]
    for name, e in report["engines"].items():
        largest = sorted(e["by_distribution"].items(), key=lambda kv: -kv[1])[:4]
        lines.append(f"{name:<11}{e['installed_mb']:>13.0f}{e['import_s']:>10.3f}  "
                     + ", ".join(f"{d} {mb:.0f}" for d, mb in largest))
    lines.append(f"\nwhole `run` process, {report['tokens']} tokens, {report['threads']} threads "
                 f"(medians of {report['repeat']})")
    lines.append(f"{'model':<16}{'engine':<11}{'wall s':>8}{'peak RSS MB':>13}")
    for entry in report["runs"]:
        for name, e in entry["engines"].items():
            lines.append(f"{entry['model']:<16}{name:<11}{e['wall_s']:>8.2f}{e['peak_rss_mb']:>13.0f}")
    return "\n".join(lines)
