"""`edgellm pull | list | show | rm | verify`: the local model store from the command line."""
from __future__ import annotations

import argparse
import json
import sys
import time

from edgellm.store.pull import DEFAULT_MAX_BYTES


def add_parsers(sub) -> None:
    pull = sub.add_parser("pull", help="fetch a model into the local store (resumable, SHA-256 checked)")
    pull.add_argument("source", help="https://... .gguf, hf://owner/repo/file.gguf[@rev], a manifest URL "
                                     "(.json), a local .gguf, or a built-in name")
    pull.add_argument("--name", default=None, metavar="NAME[:TAG]", help="store it under this name (default: from "
                                                                          "the source, tag 'latest')")
    pull.add_argument("--sha256", default=None, help="the digest the bytes must have")
    pull.add_argument("--max-size", type=_size, default=DEFAULT_MAX_BYTES, metavar="SIZE",
                      help="refuse bodies larger than this when the source does not say its size (default 256GB)")
    pull.add_argument("--timeout", type=float, default=30.0, help="seconds a connection may stay silent (30)")
    pull.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    pull.set_defaults(func=cmd_pull)

    ls = sub.add_parser("list", help="the models in the local store")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)

    show = sub.add_parser("show", help="one store model's manifest")
    show.add_argument("name", metavar="NAME[:TAG]")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=cmd_show)

    rm = sub.add_parser("rm", help="remove a model from the store (its file goes when no other tag uses it)")
    rm.add_argument("name", metavar="NAME[:TAG]")
    rm.set_defaults(func=cmd_rm)

    verify = sub.add_parser("verify", help="re-hash every model in the store against its manifest")
    verify.set_defaults(func=cmd_verify)


def _size(text: str) -> int:
    from edgellm.api.planner import parse_bytes

    try:
        return parse_bytes(text)
    except Exception as e:  # noqa: BLE001 - argparse turns this into a usage error
        raise argparse.ArgumentTypeError(str(e)) from None


class ProgressLine:
    """One line on stderr, rewritten in place on a terminal, every 10 % elsewhere."""

    def __init__(self, enabled: bool):
        self.enabled, self.tty = enabled, sys.stderr.isatty()
        self.start, self.stage, self.shown = time.monotonic(), None, -1

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        if not self.enabled:
            return
        if stage != self.stage:
            self.end()
            self.stage, self.start, self.shown = stage, time.monotonic(), -1
        rate = done / max(time.monotonic() - self.start, 1e-6) / 1e6
        share = done * 100 // total if total else None
        text = f"{stage:>10} {done / 2**20:9.1f} MiB" + (f" of {total / 2**20:.1f} ({share}%)" if total else "") \
            + f"  {rate:6.1f} MB/s"
        if self.tty:
            print(f"\r{text}", end="", file=sys.stderr, flush=True)
        elif share is not None and share // 10 > self.shown:
            self.shown = share // 10
            print(text, file=sys.stderr, flush=True)

    def end(self) -> None:
        if self.enabled and self.tty and self.stage is not None:
            print(file=sys.stderr)


def cmd_pull(args: argparse.Namespace) -> int:
    from edgellm.store import pull

    bar = ProgressLine(not args.quiet)
    try:
        manifest = pull(args.source, name=args.name, sha256=args.sha256, progress=bar, max_bytes=args.max_size,
                        timeout_s=args.timeout)
    finally:
        bar.end()
    print(f"{manifest.ref}  {manifest.size / 2**20:.1f} MiB  {manifest.family} {manifest.quantization}  "
          f"sha256:{manifest.sha256[:12]}")
    return 0


def _when(stamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp)) if stamp else "never"


def cmd_list(args: argparse.Namespace) -> int:
    from edgellm.store import Store, register_builtins

    store = Store()
    register_builtins(store)
    manifests = store.all()
    if args.json:
        print(json.dumps([m.as_dict() for m in manifests], indent=2))
        return 0
    rows = [("NAME", "SIZE", "FAMILY", "QUANT", "DIGEST", "LAST USED")]
    rows += [(str(m.ref), f"{m.size / 2**20:.1f} MiB", m.family, m.quantization, m.sha256[:12], _when(m.last_used))
             for m in manifests]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def _manifest(name: str):
    from edgellm.errors import ModelNotFound
    from edgellm.store import Store, parse_ref, register_builtin
    from edgellm.registry import REGISTRY

    store, ref = Store(), parse_ref(name)
    manifest = store.get(ref)
    if manifest is None and ref.name in REGISTRY and ref.tag == "latest":
        manifest = register_builtin(ref.name, store)
    if manifest is None:
        raise ModelNotFound(f"no model {ref} in the store ({store.root}; `edgellm list`)")
    return store, manifest


def cmd_show(args: argparse.Namespace) -> int:
    store, m = _manifest(args.name)
    if args.json:
        print(json.dumps(m.as_dict() | {"file": str(store.file_of(m))}, indent=2))
        return 0
    rows = [("name", str(m.ref)), ("file", str(store.file_of(m))), ("size", f"{m.size:,} bytes"),
            ("sha256", m.sha256), ("source", m.source), ("family", m.family), ("quantization", m.quantization),
            ("tokenizer", m.tokenizer), ("chat template", "yes" if m.chat_template else "no"),
            ("context length", str(m.context_length)), ("pulled", _when(m.created)), ("last used", _when(m.last_used))]
    for key, value in rows:
        print(f"{key:>15}  {value}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from edgellm.store import Store, parse_ref

    store, ref = Store(), parse_ref(args.name)
    freed = store.remove(ref)
    print(f"removed {ref}" + (f"; deleted {len(freed)} file(s) no other tag used" if freed else ""))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from edgellm.store import Store

    store = Store()
    problems = store.verify(progress=lambda line: print(line, file=sys.stderr))
    for ref, problem in problems:
        print(f"{ref}: {problem}")
    checked = len(store.all())
    print(f"{checked - len(problems)} of {checked} models verified" + ("" if not problems else "; pull the others again"))
    return 1 if problems else 0
