"""Downloads over HTTP(S) into a partial file that a later try resumes (HTTP Range, checked with
If-Range against the first response's ETag / Last-Modified). Nothing a server sends decides a
path: redirects go to http(s) URLs only, a body may not outgrow the size it was promised (or the
store's limit), and a stalled connection ends in an error instead of a hang."""
from __future__ import annotations

import http.client
import json
import os
import shutil
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urljoin, urlsplit

from edgellm.errors import StoreError

CHUNK = 1 << 20
MAX_REDIRECTS = 5
DISK_MARGIN = 256 << 20  # bytes a download leaves free on the store's disk
USER_AGENT = "edgellm-pull"

Progress = Callable[[int, "int | None"], None]  # (bytes so far, total or None)


class DownloadError(StoreError):
    """A download that failed: the server's answer, the connection, or a limit; a resumable
    one keeps its partial file for the next try."""


class UnsafeSource(DownloadError):
    """Something a server sent that edgellm refuses to follow (a redirect off http(s), a body
    larger than promised)."""


@dataclass(frozen=True)
class Limits:
    max_bytes: int  # the most a body may hold when its size is not known in advance
    timeout_s: float = 30.0  # per connect and per read: a silent server fails, not hangs


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UnsafeSource(f"refusing {url[:200]!r}: only http:// and https:// URLs are fetched")
    return url


def _connect(url: str, headers: dict, timeout_s: float) -> tuple[http.client.HTTPResponse, str]:
    """GET `url`, following up to MAX_REDIRECTS redirects to http(s) URLs -> (response, final URL)."""
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(check_url(url))
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout_s,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request("GET", target, headers={"User-Agent": USER_AGENT, **headers})
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise DownloadError(f"{url}: {e or type(e).__name__}") from None
        if response.status not in (301, 302, 303, 307, 308):
            return response, url
        location = response.getheader("Location")
        conn.close()
        if not location:
            raise DownloadError(f"{url}: redirect without a Location")
        url = urljoin(url, location)
        if urlsplit(url).scheme not in ("http", "https"):
            raise UnsafeSource(f"refusing a redirect to {url[:200]!r}: only http:// and https:// are followed")
    raise DownloadError(f"more than {MAX_REDIRECTS} redirects from {url}")


def fetch_small(url: str, limit: int, timeout_s: float = 30.0) -> bytes:
    """A whole small body (a manifest), at most `limit` bytes."""
    response, _ = _connect(url, {}, timeout_s)
    with response:
        if response.status != 200:
            raise DownloadError(f"{url}: HTTP {response.status} {response.reason}")
        try:
            body = response.read(limit + 1)
        except (OSError, http.client.HTTPException) as e:
            raise DownloadError(f"{url}: {e or type(e).__name__}") from None
    if len(body) > limit:
        raise UnsafeSource(f"{url}: the body is larger than {limit} bytes")
    return body


def download(url: str, partial: Path, limits: Limits, expected_size: int | None = None,
             progress: Progress = lambda done, total: None) -> int:
    """Download `url` into `partial`, resuming what an earlier try left there for the same URL;
    returns its size. The partial file stays for the next try when the connection fails, and
    goes when the server's bytes break a rule (then nothing is kept)."""
    state = partial.with_name(partial.name + ".json")
    have = _resumable(partial, state, url)
    headers = {}
    if have:
        headers["Range"] = f"bytes={have}-"
        validator = json.loads(state.read_text()).get("validator")
        if validator:
            headers["If-Range"] = validator
    response, final = _connect(url, headers, limits.timeout_s)
    with response:
        if response.status == 416 and expected_size is not None and have == expected_size:
            return have  # all there already
        if response.status == 200:
            have = 0
        elif response.status != 206 or not have:
            partial.unlink(missing_ok=True)
            raise DownloadError(f"{final}: HTTP {response.status} {response.reason}")
        elif not _range_starts_at(response, have):
            raise UnsafeSource(f"{final}: the server resumed at another byte than {have}")
        state.write_text(json.dumps({"url": url, "validator": response.getheader("ETag")
                                     or response.getheader("Last-Modified")}))
        total = _announced_total(response, have)
        limit = _check_total(final, total, expected_size, limits.max_bytes)
        _receive(response, partial, have, total, limit, final, progress)
    size = partial.stat().st_size
    if expected_size is not None and size != expected_size:
        _discard(partial, state)
        raise DownloadError(f"{final}: got {size} bytes, expected {expected_size}")
    state.unlink(missing_ok=True)
    return size


def _resumable(partial: Path, state: Path, url: str) -> int:
    try:
        same = json.loads(state.read_text()).get("url") == url
    except (OSError, ValueError, AttributeError):
        same = False
    if not same or not partial.is_file():
        _discard(partial, state)
        return 0
    return partial.stat().st_size


def _range_starts_at(response: http.client.HTTPResponse, have: int) -> bool:
    span = (response.getheader("Content-Range") or "").removeprefix("bytes ").split("-", 1)[0]
    return span.strip() == str(have)


def _announced_total(response: http.client.HTTPResponse, have: int) -> int | None:
    length = response.getheader("Content-Length")
    return have + int(length) if length and length.isdigit() else None


def _check_total(url: str, total: int | None, expected: int | None, max_bytes: int) -> int:
    """The most bytes the partial file may reach."""
    if total is not None and expected is not None and total != expected:
        raise DownloadError(f"{url}: the server offers {total} bytes, the expected size is {expected}")
    limit = expected if expected is not None else (total if total is not None else max_bytes)
    if limit > max_bytes:
        raise UnsafeSource(f"{url}: {limit} bytes is more than the store takes ({max_bytes}; --max-size)")
    return limit


def _receive(response, partial: Path, have: int, total: int | None, limit: int, url: str, progress: Progress) -> None:
    done, last = have, 0.0
    with open(partial, "ab" if have else "wb") as out:
        out.truncate(have)
        while True:
            try:
                block = response.read(CHUNK)
            except (OSError, http.client.HTTPException) as e:
                raise DownloadError(f"{url}: interrupted after {done} bytes ({e or type(e).__name__}); "
                                    "pull again to resume") from None
            if not block:
                break
            done += len(block)
            if done > limit:
                out.close()
                _discard(partial, partial.with_name(partial.name + ".json"))
                raise UnsafeSource(f"{url}: the body goes past {limit} bytes; nothing was kept")
            out.write(block)
            if shutil.disk_usage(partial.parent).free < DISK_MARGIN:
                raise DownloadError(f"{url}: the disk is nearly full after {done} bytes; free space and pull again")
            if time.monotonic() - last > 0.1:
                progress(done, total)
                last = time.monotonic()
    progress(done, total)
    if total is not None and done < total:
        raise DownloadError(f"{url}: the connection ended after {done} of {total} bytes; pull again to resume")


def _discard(*paths: Path) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
