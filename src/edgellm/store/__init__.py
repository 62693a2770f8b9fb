"""The local model store (`edgellm pull | list | show | rm | verify`): content-addressed blobs,
a manifest per `name:tag`, resumable verified downloads; `resolve` turns whatever a `--model`
names (a path, a store name, a built-in name) into a file."""
from __future__ import annotations

import os
from pathlib import Path

from edgellm import registry
from edgellm.errors import ModelNotFound
from edgellm.store.pull import pull, register_builtin, register_builtins
from edgellm.store.refs import Ref, looks_like_ref, parse_ref
from edgellm.store.store import Manifest, Store, store_root

__all__ = ["Manifest", "Ref", "Store", "parse_ref", "pull", "register_builtin", "register_builtins", "resolve",
           "store_root"]


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A path to a model file or Hugging Face folder, a store name (`name[:tag]`), or a built-in
    name -> an existing path. The store is read, never created, here."""
    key = str(name_or_path)
    path = Path(key).expanduser()
    if path.is_file() or (path / "config.json").is_file():
        return path
    store = Store()
    if looks_like_ref(key) and store.manifests.is_dir():
        manifest = store.get(parse_ref(key))
        if manifest is not None:
            file = store.file_of(manifest)
            if not file.is_file():
                raise ModelNotFound(f"{manifest.ref}'s file {file} is gone; pull it again or `edgellm rm` it")
            store.touch(manifest)
            return file
    try:
        return registry.resolve(key)
    except ModelNotFound as e:
        raise ModelNotFound(f"{e}; nor is it in the model store ({store.root}; `edgellm list`)") from None
