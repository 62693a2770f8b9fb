"""Device profiles: named TOML files (built-in phone, tablet, desktop, or a path) that set
threads, batch size, context, KV precision, prefix cache, timeouts and the queue bound."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

from edgellm.errors import InvalidRequest

BUILT_IN = ("phone", "tablet", "desktop")


@dataclass(frozen=True)
class DeviceProfile:
    name: str = "default"
    threads: int | None = None  # None: physical cores
    max_batch: int = 1  # 1: latency mode, one request at a time; more: continuous batching
    context: int | None = None  # None: the model's
    kv_precision: str | None = None  # None: the model's default (f16), as `run` and `chat` use
    prefix_cache: str | None = None  # e.g. "64MB"; "0" turns prefix reuse off; None: automatic
    timeout_s: float = 15.0
    queue_limit: int = 3
    warmup_delay_s: float | None = 2.0  # None or negative: no warmup
    speculative: str | None = None  # "lookup", "draft" (needs --draft), "self"; None: plain decoding

    def __post_init__(self) -> None:
        if self.warmup_delay_s is not None and self.warmup_delay_s < 0:
            object.__setattr__(self, "warmup_delay_s", None)
        if self.queue_limit < 0 or self.max_batch < 1 or self.timeout_s <= 0:
            raise InvalidRequest(f"profile {self.name!r}: queue_limit >= 0, max_batch >= 1, timeout_s > 0")
        if self.speculative not in (None, "lookup", "draft", "self", "off"):
            raise InvalidRequest(f"profile {self.name!r}: speculative is lookup, draft, self or off, "
                                 f"got {self.speculative!r}")


def load_profile(name_or_path: str) -> DeviceProfile:
    if name_or_path in BUILT_IN:
        text, name = resources.files("edgellm.serving").joinpath(f"profiles/{name_or_path}.toml").read_text(), name_or_path
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise InvalidRequest(f"no profile {name_or_path!r} (built-in: {', '.join(BUILT_IN)}, or a .toml path)")
        text, name = path.read_text(), path.stem
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InvalidRequest(f"profile {name!r} is not valid TOML: {e}") from None
    known = {f.name for f in fields(DeviceProfile)}
    unknown = set(values) - known
    if unknown:
        raise InvalidRequest(f"profile {name!r} has unknown settings: {', '.join(sorted(unknown))}")
    try:
        return DeviceProfile(**{"name": name, **values})
    except TypeError as e:
        raise InvalidRequest(f"profile {name!r}: {e}") from None
