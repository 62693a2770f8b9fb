"""The adapters resident over one base model, by name: loaded and unloaded at run time while
requests run. A generation holds its Adapter object, so unloading one only stops new requests
from picking it; the requests already under it finish with it, and its memory goes with the last."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator


from edgellm.errors import InvalidRequest, ModelNotFound
from edgellm.lora.adapter import Adapter, load_adapter


class AdapterSet:
    """`kv`: the model's KV manager, whose byte budget (if any) pays for adapters loaded at run
    time (those the budget was planned with come in with charge=False)."""

    def __init__(self, config: Any, dtype: str, kv=None):
        # the pairs' dtype: int8 in fast mode (the native layers read it), float32 in exact
        self.config, self.dtype, self.kv = config, dtype, kv
        self._by_name: dict[str, Adapter] = {}
        self._charged: dict[str, int] = {}  # bytes lent by the KV budget, per name
        self._lock = threading.Lock()

    def load(self, path: str | Path, name: str | None = None, scale: float = 1.0, charge: bool = True) -> Adapter:
        """Read and check the adapter at `path` and make it resident as `name` (default: the
        file or folder name); a resident adapter of that name is replaced (its running requests
        keep it). Under a memory budget its bytes come off the KV budget (OutOfMemoryBudget if
        running requests hold it)."""
        name = name or Path(path).stem
        if not name or ":" in name or "/" in name:
            raise InvalidRequest(f"an adapter name must be non-empty without ':' or '/', got {name!r}")
        if not 0.0 <= scale <= 100.0:
            raise InvalidRequest(f"an adapter scale must be in [0, 100], got {scale}")
        adapter = load_adapter(path, self.config, name, scale, self.dtype)  # outside the lock: may take a while
        with self._lock:
            lent = adapter.nbytes if charge and self.kv is not None else 0
            held = self._charged.get(name, 0)  # a replaced adapter's bytes pay for its successor first
            if lent > held:
                self.kv.lend(lent - held, f"the LoRA adapter {name!r}")  # refused: the old one stays
            self._give_back(max(held - lent, 0))
            self._by_name[name] = adapter
            self._charged[name] = lent
        return adapter

    def _give_back(self, nbytes: int) -> None:
        if nbytes:
            self.kv.give_back(nbytes)

    def unload(self, name: str) -> Adapter:
        with self._lock:
            adapter = self._by_name.pop(name, None)
            self._give_back(self._charged.pop(name, 0))  # freed once its last running request ends
        if adapter is None:
            raise self._unknown(name)
        return adapter

    def get(self, adapter: str | Adapter | None) -> Adapter | None:
        """The resident adapter of a name (an Adapter passes through; None: the base)."""
        if adapter is None or isinstance(adapter, Adapter):
            return adapter
        with self._lock:
            found = self._by_name.get(adapter)
        if found is None:
            raise self._unknown(adapter)
        return found

    def _unknown(self, name: str) -> ModelNotFound:
        loaded = ", ".join(sorted(a.name for a in self)) or "none"
        return ModelNotFound(f"no adapter {name!r} is loaded (loaded: {loaded})")

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for a in self._by_name.values())

    def __iter__(self) -> Iterator[Adapter]:
        with self._lock:
            return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)
