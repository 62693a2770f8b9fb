"""`edgellm pull` against a real HTTP server on 127.0.0.1: what lands in the store, resuming, digests,
and every way a server may misbehave, each refused with nothing written outside the store and nothing
good replaced."""
from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest

import edgellm
from edgellm.errors import InvalidRequest, ModelFormatError, ModelNotFound, StoreError
from edgellm.store import parse_ref, pull, resolve
from edgellm.store.fetch import DownloadError, UnsafeSource
from edgellm.store.store import DigestMismatch


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def stored(store) -> set[str]:
    """The blobs and manifests (the partial folder's locks are not model files)."""
    return {f for f in files_under(store.root) if not f.startswith("partial")}


def test_a_pulled_url_is_stored_by_digest_named_and_runs(server, store, tiny_ggufs):
    data = tiny_ggufs[0].read_bytes()
    url = server.add("/models/Tiny-Llama.Q8.gguf", body=data)
    manifest = pull(url, store=store)
    assert (manifest.name, manifest.tag) == ("tiny-llama.q8", "latest")
    assert manifest.sha256 == sha(data) and manifest.size == len(data)
    assert (manifest.family, manifest.source) == ("llama", url)
    blob = store.blob_path(manifest.sha256)
    assert blob.read_bytes() == data and not blob.stat().st_mode & 0o222  # read-only
    assert stored(store) == {f"blobs/{blob.name}", "manifests/tiny-llama.q8/latest.json"}
    assert resolve("tiny-llama.q8") == blob == resolve("tiny-llama.q8:latest")
    with edgellm.load("tiny-llama.q8") as model:
        assert len(model.generate([1, 2, 3], max_tokens=3, ignore_eos=True).token_ids) == 3
    assert store.get(parse_ref("tiny-llama.q8")).last_used is not None


def test_an_interrupted_pull_resumes_where_it_stopped(server, store, tiny_ggufs):
    data = tiny_ggufs[0].read_bytes()
    cut = len(data) // 3
    url = server.add("/tiny.gguf", body=data, drop_after=cut)
    with pytest.raises(DownloadError, match="pull again to resume"):
        pull(url, name="tiny:v1", store=store)
    assert store.get(parse_ref("tiny:v1")) is None
    assert [p.stat().st_size for p in store.partial.glob("*.part")] == [cut]
    manifest = pull(url, name="tiny:v1", store=store)
    assert server.routes["/tiny.gguf"].hits == [None, f"bytes={cut}-"]  # the second asked for the rest only
    assert manifest.sha256 == sha(data) and not list(store.partial.glob("*.part"))


def test_a_changed_file_is_fetched_again_whole(server, store, tiny_ggufs):
    first, second = (p.read_bytes() for p in tiny_ggufs)
    url = server.add("/m.gguf", body=first, drop_after=1000)
    with pytest.raises(DownloadError):
        pull(url, name="m", store=store)
    server.routes["/m.gguf"].body = second  # another ETag: If-Range makes the server send it all
    assert pull(url, name="m", store=store).sha256 == sha(second)


def test_a_digest_mismatch_keeps_the_good_model(server, store, tiny_ggufs):
    good, other = (p.read_bytes() for p in tiny_ggufs)
    url = server.add("/m.gguf", body=good)
    before = pull(url, name="m:v1", store=store)
    server.routes["/m.gguf"].body = other  # the server now sends other bytes than the digest promised
    with pytest.raises(DigestMismatch, match="nothing was stored"):
        pull(url, name="m:v1", sha256=sha(good).upper(), store=store)
    assert store.get(parse_ref("m:v1")) == before and resolve("m:v1").read_bytes() == good
    assert stored(store) == {f"blobs/sha256-{sha(good)}", "manifests/m/v1.json"}
    assert not list(store.partial.glob("*.part"))


def test_bytes_that_are_no_gguf_are_not_stored(server, store, tiny_ggufs):
    pull(server.add("/good.gguf", body=tiny_ggufs[0].read_bytes()), name="m", store=store)
    url = server.add("/html.gguf", body=b"<html>rate limited</html>" * 100)
    with pytest.raises(ModelFormatError, match="not a GGUF file.*nothing was stored"):
        pull(url, name="m", store=store)
    assert resolve("m").read_bytes() == tiny_ggufs[0].read_bytes()
    assert len(list(store.blobs.iterdir())) == 1


def test_concurrent_pulls_of_one_blob_store_it_once(server, store, tiny_ggufs):
    data = tiny_ggufs[0].read_bytes()
    url = server.add("/m.gguf", body=data)
    results, errors = [], []

    def one(name: str) -> None:
        try:
            results.append(pull(url, name=name, sha256=sha(data), store=store))
        except Exception as e:  # noqa: BLE001 - the assertion below shows it
            errors.append(e)

    threads = [threading.Thread(target=one, args=(f"m:v{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4
    assert [p.name for p in store.blobs.iterdir()] == [f"sha256-{sha(data)}"]


def test_tags_share_a_blob_until_the_last_goes(server, store, tiny_ggufs):
    data = tiny_ggufs[0].read_bytes()
    url = server.add("/m.gguf", body=data)
    pull(url, name="a:v1", store=store)
    pull(url, name="b", store=store)
    blob = store.blob_path(sha(data))
    assert store.remove(parse_ref("a:v1")) == [] and blob.is_file()
    assert store.remove(parse_ref("b")) == [blob] and not blob.exists()
    with pytest.raises(ModelNotFound):
        store.remove(parse_ref("b"))
    assert stored(store) == set()


def test_a_new_version_under_a_tag_replaces_the_old_blob(server, store, tiny_ggufs):
    first, second = (p.read_bytes() for p in tiny_ggufs)
    pull(server.add("/1.gguf", body=first), name="m", store=store)
    pull(server.add("/2.gguf", body=second), name="m", store=store)
    assert [p.name for p in store.blobs.iterdir()] == [f"sha256-{sha(second)}"]


def test_hf_paths_go_through_hf_endpoint(server, store, tiny_ggufs, monkeypatch):
    data = tiny_ggufs[0].read_bytes()
    server.add("/owner/repo/resolve/v2/sub/Model-Q8_0.gguf", body=data)
    monkeypatch.setenv("HF_ENDPOINT", server.base)
    manifest = pull("hf://owner/repo/sub/Model-Q8_0.gguf@v2", store=store)
    assert manifest.name == "model-q8_0" and manifest.sha256 == sha(data)
    with pytest.raises(InvalidRequest):
        pull("hf://owner/../file.gguf", store=store)


def test_a_manifest_url_gives_name_tag_digest_and_size(server, store, tiny_ggufs):
    data = tiny_ggufs[0].read_bytes()
    server.add("/files/blob.bin", body=data)
    url = server.add_json("/m/manifest.json", {"url": "../files/blob.bin", "sha256": sha(data), "size": len(data),
                                              "name": "assistant", "tag": "v3"})
    manifest = pull(url, store=store)
    assert str(manifest.ref) == "assistant:v3" and manifest.source == server.base + "/files/blob.bin"
    pull(url, store=store)  # the blob is there: nothing is fetched again
    assert server.routes["/files/blob.bin"].hits == [None]


def test_a_local_file_is_copied_in(store, tiny_ggufs):
    manifest = pull(str(tiny_ggufs[1]), store=store)
    assert manifest.name == "tiny-2" and resolve("tiny-2").read_bytes() == tiny_ggufs[1].read_bytes()


def test_verify_finds_a_changed_blob(server, store, tiny_ggufs):
    manifest = pull(server.add("/m.gguf", body=tiny_ggufs[0].read_bytes()), name="m", store=store)
    assert store.verify() == []
    blob = store.blob_path(manifest.sha256)
    blob.chmod(0o644)
    with open(blob, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    assert [(str(ref), "sha256" in problem) for ref, problem in store.verify()] == [("m:latest", True)]


# -- a hostile server ---------------------------------------------------------------------------------


def assert_nothing_written(tmp_path: Path, before: set[str], store) -> None:
    assert files_under(tmp_path) - before <= {f"home/partial/{p.name}" for p in store.partial.glob("*.lock")}


@pytest.mark.parametrize("manifest, error", [
    ({"url": "m.gguf", "sha256": "0" * 64, "name": "../../evil"}, InvalidRequest),
    ({"url": "m.gguf", "sha256": "0" * 64, "name": "ok", "tag": "../x"}, InvalidRequest),
    ({"url": "m.gguf", "sha256": "../../../etc/passwd"}, InvalidRequest),
    ({"url": "m.gguf", "sha256": "/" + "a" * 63}, InvalidRequest),
    ({"url": "file:///etc/passwd", "sha256": "0" * 64}, UnsafeSource),
    ({"url": "m.gguf", "sha256": "0" * 64, "size": "../x"}, UnsafeSource),
    (["not", "an", "object"], UnsafeSource),
])
def test_a_hostile_manifest_is_refused(server, store, tmp_path, manifest, error):
    server.add("/m.gguf", body=b"GGUF" + bytes(100))
    url = server.add_json("/manifest.json", manifest)
    before = files_under(tmp_path)
    with pytest.raises(error):
        pull(url, store=store)
    assert_nothing_written(tmp_path, before, store)
    assert server.routes["/m.gguf"].hits == []  # refused before any download


def test_a_redirect_to_a_local_file_is_refused(server, store, tmp_path):
    url = server.add("/m.gguf", redirect="file:///etc/passwd")
    before = files_under(tmp_path)
    with pytest.raises(UnsafeSource, match="only http:// and https://"):
        pull(url, store=store)
    assert_nothing_written(tmp_path, before, store)


def test_redirects_between_http_urls_are_followed(server, store, tiny_ggufs):
    data = tiny_ggufs[0].read_bytes()
    server.add("/real.gguf", body=data)
    assert pull(server.add("/moved.gguf", redirect="/real.gguf"), name="m", store=store).sha256 == sha(data)


def test_an_endless_body_is_cut_at_the_limit(server, store, tmp_path):
    url = server.add("/endless.gguf", endless=True)
    before = files_under(tmp_path)
    with pytest.raises(UnsafeSource, match="nothing was kept"):
        pull(url, store=store, max_bytes=4 << 20)
    assert_nothing_written(tmp_path, before, store)


def test_a_body_longer_than_its_manifest_says_is_refused(server, store, tmp_path, tiny_ggufs):
    data = tiny_ggufs[0].read_bytes()
    server.add("/m.gguf", body=data)
    url = server.add_json("/manifest.json", {"url": "m.gguf", "sha256": sha(data), "size": 1000})
    with pytest.raises(StoreError, match="1000"):
        pull(url, store=store)
    assert stored(store) == set()


@pytest.mark.parametrize("source", ["file:///etc/passwd", "ftp://127.0.0.1/m.gguf", "/no/such/file.gguf"])
def test_sources_that_are_no_http_path_or_name_are_refused(store, source):
    with pytest.raises((UnsafeSource, ModelNotFound)):
        pull(source, store=store)


def test_names_in_urls_never_become_paths(server, store, tmp_path, tiny_ggufs):
    url = server.add("/%2e%2e%2f%2e%2e%2fevil.gguf", body=tiny_ggufs[0].read_bytes())
    manifest = pull(url, store=store)
    assert "/" not in manifest.name and ".." not in manifest.name
    assert all(f.startswith(("blobs/", "manifests/")) for f in stored(store))
    with pytest.raises(InvalidRequest):
        pull(url, name="../../evil", store=store)
