"""Several models behind one server. Each served name is a Deployment whose current version is
loaded on its first request, kept while it is used (and a keep-alive time after), and unloaded
least recently used first when the memory budget needs the room for another. Every version runs
its engine in the thread that loaded it (see Service.run_forever), so a load never stops the
engines of the models already loaded.

A hot swap loads a new version beside the old one, checks it with a canary request through its own
service, then sends new requests to it while the old version finishes the ones it holds; a version
that fails to load or to answer is dropped and the old one stays. The version swapped out is
remembered for `rollback`."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from edgellm.errors import EdgeLLMError, InvalidRequest, ModelNotFound, OutOfMemoryBudget, type_and_stack
from edgellm.generation import Completion
from edgellm.serving.handle import Request
from edgellm.serving.service import Service

log = logging.getLogger("edgellm.serving.router")

CANARY = Request("Hello", {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}, warmup=True, timeout_s=120.0)

LoadModel = Callable[[str, "int | None"], object]  # (what to load, its memory budget or None) -> Model
MakeService = Callable[[object], Service]  # a model -> its service, not started (its thread runs it)
Footprint = Callable[[str], int]  # bytes of the server's budget a model holds once loaded


@dataclass(frozen=True)
class Catalog:
    """What a server of several models is given: model id -> what it loads (a store name, a built-in
    name or a path), how to load one, and the memory rules."""
    deployments: dict[str, str]
    load: LoadModel
    budget: int | None = None  # bytes for the whole process (--memory); None: no budget
    footprint: Footprint | None = None
    baseline: int = 0  # bytes the process holds with no model (the runtime)
    keep_alive_s: float | None = None  # None: a model stays loaded until its room is needed
    preload: tuple[str, ...] = ()  # ids loaded at start


class SwapFailed(EdgeLLMError):
    """A new version that did not load or did not answer its canary: the old one stays."""


class Version:
    """One loaded model and the engine thread that loaded it and runs its service."""

    def __init__(self, ref: str, charge: int, load: LoadModel, budget: int | None, make_service: MakeService,
                 model=None, service: Service | None = None):
        self.ref, self.charge = ref, charge
        self.users, self.last_used = 0, time.monotonic()
        self.load_s = 0.0
        self.model, self.service, self.error = model, service, None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        if service is not None:  # an app's own model and service: never unloaded here
            self._ready.set()
            return
        self._thread = threading.Thread(target=self._run, args=(load, budget, make_service),
                                        name=f"edgellm-engine-{ref}", daemon=True)
        self._thread.start()

    @property
    def owned(self) -> bool:
        return self._thread is not None

    def _run(self, load: LoadModel, budget: int | None, make_service: MakeService) -> None:
        start = time.perf_counter()
        try:
            self.model = load(self.ref, budget)
            self.service = make_service(self.model)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits for this version
            self.error = error
            if self.model is not None:
                self.model.close()
            return
        finally:
            self.load_s = time.perf_counter() - start
            self._ready.set()
        try:
            self.service.run_forever()
        finally:
            self.model.close()

    def wait_loaded(self) -> "Version":
        self._ready.wait()
        if self.error is not None:
            raise self.error
        return self

    @property
    def idle(self) -> bool:
        return self.users == 0 and self.service is not None and self.service.idle

    def close(self) -> None:
        if not self.owned:
            return
        self._ready.wait()
        if self.service is not None:
            self.service.close()
        self._thread.join(timeout=60)


@dataclass
class Deployment:
    name: str  # the model id clients send
    ref: str  # what its current version loads: a store name, a built-in name or a path
    current: Version | None = None
    previous: str | None = None  # the version a swap replaced, for rollback
    swapping: threading.Lock = field(default_factory=threading.Lock)


class Router:
    def __init__(self, deployments: dict[str, str], load: LoadModel, make_service: MakeService, *,
                 budget: int | None = None, footprint: Footprint | None = None, baseline: int = 0,
                 keep_alive_s: float | None = None):
        """`deployments`: model id -> what it loads. With `budget` (bytes), `footprint(ref)` says what a
        version holds of it, `baseline` what the process holds anyway."""
        if not deployments:
            raise InvalidRequest("a server needs at least one model")
        self.deployments = {name: Deployment(name, ref) for name, ref in deployments.items()}
        self.load, self.make_service = load, make_service
        self.budget, self.footprint, self.baseline, self.keep_alive_s = budget, footprint, baseline, keep_alive_s
        self._lock = threading.Lock()
        self._held = 0  # bytes of the budget held by versions loaded or loading
        self._draining: list[Version] = []  # swapped out, finishing their requests
        self.loads = self.evictions = self.unloads = 0  # counters for the metrics

    @classmethod
    def of_model(cls, name: str, model, service: Service) -> "Router":
        """One deployment of an already loaded model and its service (an app's own)."""
        router = cls({name: name}, load=_no_load, make_service=_no_service)
        router.deployments[name].current = Version(name, 0, _no_load, None, _no_service, model, service)
        return router

    # -- looking up --------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self.deployments)

    def find(self, requested: str) -> tuple[Deployment, str | None]:
        """The deployment a request's `model` names, and the adapter after it ("name:adapter")."""
        if requested in self.deployments:
            return self.deployments[requested], None
        for name in sorted(self.deployments, key=len, reverse=True):
            if requested.startswith(name + ":"):
                return self.deployments[name], requested[len(name) + 1:]
        raise ModelNotFound(f"model {requested!r} does not exist; this server serves "
                            + ", ".join(repr(n) for n in self.deployments))

    def loaded(self) -> list[tuple[str, Version]]:
        return [(d.name, d.current) for d in self.deployments.values() if d.current is not None
                and d.current.service is not None]

    # -- using a version -----------------------------------------------------------------------

    def acquire(self, name: str) -> Version:
        """The current version of `name`, loaded first when it is not (this thread waits; others
        go on), counted as in use until release()."""
        deployment = self.deployments[name]
        while True:
            with self._lock:
                version = deployment.current
                if version is None:
                    version = deployment.current = self._start_version(deployment.ref, exclude=deployment)
                version.users += 1
            try:
                version.wait_loaded()
            except BaseException:
                with self._lock:
                    version.users -= 1
                    if deployment.current is version:  # the next request tries again
                        deployment.current = None
                        self._held -= version.charge
                raise
            if deployment.current is version:
                version.last_used = time.monotonic()
                return version
            self.release(version)  # swapped meanwhile: take the new one

    def release(self, version: Version) -> None:
        with self._lock:
            version.users -= 1
            version.last_used = time.monotonic()
        self.release_drained()

    def _start_version(self, ref: str, exclude: Deployment | None) -> Version:
        """A version of `ref` loading in its own thread, its room in the budget taken (under the lock)."""
        charge = self.footprint(ref) if self.budget is not None and self.footprint is not None else 0
        if self.budget is not None:
            self._make_room(charge, exclude)
        self._held += charge
        self.loads += 1
        budget = charge + self.baseline if self.budget is not None else None
        return Version(ref, charge, self.load, budget, self.make_service)

    def _make_room(self, charge: int, exclude: Deployment | None) -> None:
        """Unload idle versions, least recently used first, until `charge` bytes fit the budget."""
        free = self.budget - self.baseline - self._held
        idle = sorted((d for d in self.deployments.values() if d is not exclude and d.current is not None
                       and d.current.owned and d.current.idle), key=lambda d: d.current.last_used)
        while free < charge and idle:
            victim = idle.pop(0)
            version, victim.current = victim.current, None
            self._held -= version.charge
            free += version.charge
            self.evictions += 1
            log.info("unloading %s (%s) to make room", victim.name, version.ref)
            threading.Thread(target=version.close, daemon=True).start()
        if free < charge:
            raise OutOfMemoryBudget(charge, max(free, 0), "loading another model (the others are busy)")

    # -- versions --------------------------------------------------------------------------------

    def swap(self, name: str, ref: str) -> dict:
        """Make `ref` the current version of `name` once it loads and answers a canary request;
        in-flight requests finish on the old version. SwapFailed (the old one stays) otherwise."""
        deployment = self.deployments[name]
        with deployment.swapping:
            started = time.perf_counter()
            with self._lock:
                version = self._start_version(ref, exclude=deployment)  # OutOfMemoryBudget: nothing changed
            try:
                version.wait_loaded()
            except BaseException as error:
                self._forget(version)
                raise SwapFailed(f"{ref} did not load: {error}") from None
            loaded = time.perf_counter()
            try:
                _canary(version.service)
            except BaseException as error:
                self._forget(version)
                raise SwapFailed(f"{ref} loaded but did not answer: {error}") from None
            checked = time.perf_counter()
            with self._lock:
                old = deployment.current
                if deployment.ref != ref:
                    deployment.previous = deployment.ref
                deployment.ref, deployment.current = ref, version
                version.last_used = time.monotonic()
                if old is not None:
                    self._draining.append(old)
            self.release_drained()
            switched = time.perf_counter()
        log.info("swapped %s to %s (previous %s)", name, ref, deployment.previous)
        return {"id": name, "model": ref, "previous": deployment.previous, "load_s": round(loaded - started, 3),
                "canary_s": round(checked - loaded, 3), "switch_s": round(switched - checked, 6)}

    def rollback(self, name: str) -> dict:
        previous = self.deployments[name].previous
        if previous is None:
            raise InvalidRequest(f"{name} has no previous version to roll back to")
        return self.swap(name, previous)

    def _forget(self, version: Version | None) -> None:
        if version is None:
            return
        with self._lock:
            self._held -= version.charge
        version.close()

    def release_drained(self) -> None:
        with self._lock:
            drained = [v for v in self._draining if v.idle]
            self._draining = [v for v in self._draining if v not in drained]
            self._held -= sum(v.charge for v in drained)
        for old in drained:
            if old.owned:
                old.close()

    # -- keeping memory ------------------------------------------------------------------------

    def reap(self, now: float | None = None) -> list[str]:
        """Unload versions idle past the keep-alive time; close drained ones. Returns the names unloaded."""
        self.release_drained()
        if self.keep_alive_s is None:
            return []
        now = time.monotonic() if now is None else now
        gone = []
        with self._lock:
            for d in self.deployments.values():
                v = d.current
                if v is not None and v.owned and v.idle and now - v.last_used > self.keep_alive_s:
                    d.current = None
                    self._held -= v.charge
                    self.unloads += 1
                    gone.append((d.name, v))
        for name, version in gone:
            log.info("unloading %s (%s): idle for %.0f s", name, version.ref, self.keep_alive_s)
            version.close()
        return [name for name, _ in gone]

    def close(self) -> None:
        with self._lock:
            versions = [d.current for d in self.deployments.values() if d.current is not None] + self._draining
            for d in self.deployments.values():
                d.current = None
            self._draining = []
        for version in versions:
            try:
                version.close()
            except Exception as error:  # noqa: BLE001 - closing the rest matters more
                log.error("closing %s failed: %s", version.ref, type_and_stack(error))

    @property
    def held_bytes(self) -> int:
        return self._held


def _canary(service: Service) -> None:
    """A short greedy request through the version's own service must give tokens."""
    done = None
    for event in service.submit(CANARY):  # an error that ends it is raised here
        if isinstance(event, Completion):
            done = event
    if done is None or done.timings.completion_tokens < 1 or done.finish_reason not in ("length", "stop"):
        raise SwapFailed(f"the canary request gave {'nothing' if done is None else repr(done.finish_reason)}")


def _no_load(ref: str, budget: int | None):
    raise ModelNotFound(f"{ref} is not loaded here")


def _no_service(model) -> Service:
    raise ModelNotFound("no service")
