"""Device profiles: the built-ins load, user files are validated, serve applies them."""
from __future__ import annotations

import pytest

from edgellm.errors import InvalidRequest
from edgellm.serving.profile import BUILT_IN, load_profile


@pytest.mark.parametrize("name", BUILT_IN)
def test_built_in_profiles_load(name):
    profile = load_profile(name)
    assert profile.name == name and profile.queue_limit >= 1 and profile.timeout_s > 0


def test_phone_is_the_frugal_one():
    phone, desktop = load_profile("phone"), load_profile("desktop")
    assert phone.kv_precision == "int8" and phone.context < desktop.context and phone.queue_limit < desktop.queue_limit


def test_user_profile_file(tmp_path):
    path = tmp_path / "kiosk.toml"
    path.write_text('threads = 1\nqueue_limit = 1\ntimeout_s = 5.0\nkv_precision = "int4"\nspeculative = "lookup"\n')
    profile = load_profile(str(path))
    assert (profile.name, profile.threads, profile.queue_limit, profile.kv_precision) == ("kiosk", 1, 1, "int4")
    assert profile.speculative == "lookup"


@pytest.mark.parametrize("text, message", [("threads = \n", "TOML"), ("speed = 3\n", "unknown settings"),
                                           ("max_batch = 0\n", "max_batch"), ("queue_limit = -1\n", "queue_limit"),
                                           ('speculative = "magic"\n', "speculative")])
def test_bad_profiles_are_rejected(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(InvalidRequest, match=message):
        load_profile(str(path))


def test_unknown_profile_name():
    with pytest.raises(InvalidRequest, match="built-in"):
        load_profile("toaster")
