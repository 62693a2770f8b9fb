"""Streaming text: stop strings across token boundaries, UTF-8 held back until complete."""
from __future__ import annotations

import pytest

from edgellm.generation.text import IncrementalDetokenizer, StopMatcher


def _run_stops(stops, pieces):
    matcher = StopMatcher(tuple(stops))
    released = [matcher.push(p) for p in pieces]
    tail = "" if matcher.matched else matcher.flush()
    return released, tail, matcher.matched


def test_stop_string_split_across_tokens_is_caught_and_not_emitted():
    released, tail, matched = _run_stops(["\n\nUser:"], ["Hello", " there", "\n", "\nUs", "er:", " ignored"][:5])
    assert matched == "\n\nUser:"
    assert "".join(released) == "Hello there"
    assert released == ["Hello", " there", "", "", ""]  # nothing that could start the stop leaks


def test_partial_match_that_fails_is_released():
    released, tail, matched = _run_stops(["STOP"], ["ST", "OR", "Y"])
    assert matched is None
    assert "".join(released) + tail == "STORY"
    assert released[0] == ""  # "ST" was held back while it could still become STOP


def test_earliest_of_several_stops_wins():
    released, _, matched = _run_stops(["cd", "b"], ["abcd"])
    assert matched == "b" and released == ["a"]


def test_stop_inside_one_token():
    released, _, matched = _run_stops(["###"], ["answer###more"])
    assert matched == "###" and released == ["answer"]


def test_no_stops_passes_text_through():
    assert _run_stops([], ["a", "b"]) == (["a", "b"], "", None)


def test_held_back_text_is_flushed_at_the_end():
    released, tail, matched = _run_stops(["</s>"], ["end</"])
    assert released == ["end"] and tail == "</" and matched is None


def _detok(byte_tokens):
    return IncrementalDetokenizer(lambda i: byte_tokens[i])


@pytest.mark.parametrize("text", ["héllo", "你好世界", "👩‍👩‍👧 family", "🇯🇵", "mixed 日本 and 🎉!"])
def test_multibyte_characters_split_into_single_byte_tokens_never_break(text):
    data = text.encode()
    detok = _detok([bytes([b]) for b in data])
    deltas = [detok.push(i) for i in range(len(data))]
    for delta in deltas:
        delta.encode("utf-8")  # every delta is valid text on its own
        assert "\ufffd" not in delta
    assert "".join(deltas) + detok.flush() == text


def test_truncated_character_at_end_becomes_replacement_char():
    detok = _detok([b"ok", "é".encode()[:1]])
    assert detok.push(0) == "ok"
    assert detok.push(1) == ""
    assert detok.flush() == "\ufffd"
