"""`edgellm serve`: one model or several behind the OpenAI-compatible server. Each model loads on
its first request (the first one at start), stays while used and `--keep-alive` after, and makes
room for another under `--memory` by unloading the least recently used."""
from __future__ import annotations

import argparse
import copy
import gc
import logging
import sys
import threading
import time

from edgellm.entrypoints.cli.generate import loads_a_model
from edgellm.errors import InvalidRequest
from edgellm.registry import DEFAULT_MODEL

DEFAULT_KEEP_ALIVE_S = 300.0  # with several models; one model stays loaded


def served_models(specs: list[str]) -> dict[str, str]:
    """`--model [ID=]MODEL` flags -> model id -> what it loads (the id defaults to MODEL as given)."""
    served: dict[str, str] = {}
    for spec in specs or [DEFAULT_MODEL]:
        name, sep, ref = spec.partition("=")
        if not sep or "/" in name or not name:  # no alias (or an '=' inside a path)
            name, ref = spec, spec
        if name in served:
            raise InvalidRequest(f"two --model flags serve the id {name!r}: give one another (--model ID=MODEL)")
        served[name] = ref
    return served


def keep_alive(text: str | None, models: int) -> float | None:
    """--keep-alive: seconds ("300", "5m", "1h"); "never" (or none given for one model): no unloading."""
    if text is None:
        return None if models == 1 else DEFAULT_KEEP_ALIVE_S
    if text.strip().lower() in ("never", "forever", "-1"):
        return None
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        value = float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)
    except (ValueError, IndexError):
        raise InvalidRequest(f"--keep-alive {text!r}: expected seconds, e.g. 300, 5m, 1h or never") from None
    if value < 0:
        raise InvalidRequest(f"--keep-alive must be 0 or more, got {text!r}")
    return value


def _loader(args: argparse.Namespace, context: int | None, lora_for: str):
    """load(ref, budget) for the router: a model as `run` would load it, with its share of --memory."""
    from edgellm.api.loader import load
    from edgellm.entrypoints.cli.generate import _kv_config, lora_specs
    from edgellm.store import resolve

    def load_one(ref: str, budget: int | None):
        one = copy.copy(args)
        one.model = ref
        start = time.perf_counter()
        model = load(resolve(ref), mode=args.mode, threads=args.threads, kv=_kv_config(one), memory_budget=budget,
                     context_length=context, speculative=args.speculative, draft=args.draft,
                     lora=lora_specs(args) if ref == lora_for else None)
        print(f"loaded {ref} in {time.perf_counter() - start:.2f} s", file=sys.stderr)
        return model

    return load_one


def _footprint(budget: int, baseline: int, context: int | None, models: int):
    """What a model holds of the budget: all of it when it is the only one; else its weights,
    tokenizer, scratch and margin, and its KV for the context the planner gives it."""
    from edgellm.api.planner import plan_file
    from edgellm.errors import OutOfMemoryBudget
    from edgellm.store import resolve

    def footprint(ref: str) -> int:
        if models == 1:
            return budget - baseline
        fitted = plan_file(resolve(ref), budget, want_context=context, runtime_bytes=baseline)
        if not fitted.fits:
            raise OutOfMemoryBudget(fitted.budget_bytes - fitted.kv_budget_bytes, fitted.budget_bytes, ref)
        return fitted.budget_bytes - fitted.kv_budget_bytes - fitted.runtime_bytes + fitted.kv_bytes

    return footprint


def _upstream(args: argparse.Namespace):
    """--fallback-url and its flags, or None."""
    if not args.fallback_url:
        return None
    import os

    from edgellm.entrypoints.http.upstream import Upstream

    reasons = frozenset(r.strip() for r in args.fallback_on.split(",") if r.strip())
    return Upstream(args.fallback_url, os.environ.get(args.fallback_key_env), reasons, args.fallback_upstream_model)


@loads_a_model
def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from edgellm.api.planner import parse_bytes, runtime_baseline
    from edgellm.entrypoints.http.app import create_app
    from edgellm.memory import keep_out_of_collections
    from edgellm.serving.profile import DeviceProfile, load_profile
    from edgellm.serving.router import Catalog
    from edgellm.serving.thermal import ThermalGovernor
    from edgellm.store import resolve
    from edgellm.threads import default_threads, free_cores

    profile = load_profile(args.profile) if args.profile else DeviceProfile()
    if args.timeout is not None and args.timeout <= 0:
        raise InvalidRequest(f"--timeout must be more than 0 seconds, got {args.timeout}")
    served = served_models(args.model)
    for ref in served.values():  # a bad name fails now, not at its first request
        resolve(ref)
    if args.threads is None:  # never more than the cores free now (oversubscription costs 10x, see free_cores)
        free = free_cores()
        args.threads = min(profile.threads or free, free)
        if free < default_threads():
            print(f"{default_threads() - free} of {default_threads()} cores are busy with other work: "
                  f"using {args.threads} thread(s) (--threads overrides)", file=sys.stderr)
    args.kv_precision = args.kv_precision or profile.kv_precision
    args.prefix_cache = args.prefix_cache if args.prefix_cache is not None else profile.prefix_cache
    args.speculative = args.speculative or profile.speculative
    logging.basicConfig(level=logging.DEBUG if args.log_text else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    budget = parse_bytes(args.memory) if args.memory is not None else None
    baseline = runtime_baseline()
    first = next(iter(served))
    catalog = Catalog(served, _loader(args, profile.context, served[first]), budget=budget,
                      footprint=_footprint(budget, baseline, profile.context, len(served)) if budget else None,
                      baseline=baseline, keep_alive_s=keep_alive(args.keep_alive, len(served)), preload=(first,))
    fallback = None
    if args.fallback_model:
        from edgellm.api.loader import load

        fallback = load(args.fallback_model, threads=args.threads)
    thermal = ThermalGovernor(args.thermal_source, threshold_c=args.thermal_threshold)
    app = create_app(catalog=catalog, api_key=args.api_key, thermal=thermal, upstream=_upstream(args),
                     protect_metrics=args.protect_metrics, cors_origins=tuple(args.cors_origin), kv_dir=args.kv_dir,
                     queue_limit=profile.queue_limit if args.queue_limit is None else args.queue_limit,
                     timeout_s=profile.timeout_s if args.timeout is None else args.timeout, log_text=args.log_text,
                     warmup_delay_s=profile.warmup_delay_s, max_batch=profile.max_batch, fallback_model=fallback)
    keep_out_of_collections()  # the first model stays: its objects need no more scans
    gc.enable()  # loads_a_model paused the collector for the imports and the first load
    names = ", ".join(served)
    print(f"serving {names} ({profile.name} profile) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
    server.install_signal_handlers = lambda: None  # signals stay with this (main) thread
    http = threading.Thread(target=server.run, name="edgellm-http", daemon=True)
    http.start()
    try:
        while http.is_alive():
            http.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(timeout=10)
        app.state.router.close()
    return 0
