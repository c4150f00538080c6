from __future__ import annotations

from gateway.text import TextStream


class CharTokenizer:
    """token id = a character's code point."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def _ids(s: str) -> list[int]:
    return [ord(c) for c in s]


def test_plain_deltas() -> None:
    t = TextStream(CharTokenizer(), [])
    assert t.add(_ids("ab")) + t.add(_ids("c")) == "abc"


def test_stop_sequence_cuts_and_holds_back_prefixes() -> None:
    t = TextStream(CharTokenizer(), ["\n\n"])
    assert t.add(_ids("x = 1\n")) == "x = 1"  # "\n" could start the stop: held back
    assert not t.stopped
    assert t.add(_ids("\ny")) == ""
    assert t.stopped and t.emitted == "x = 1"


def test_held_back_prefix_is_released() -> None:
    t = TextStream(CharTokenizer(), ["END"])
    assert t.add(_ids("aE")) == "a"
    assert t.add(_ids("x")) == "Ex"
    assert t.add(_ids("EN"), final=True) == "EN"


def test_include_stop_keeps_the_stop_sequence() -> None:
    t = TextStream(CharTokenizer(), ["END"], include_stop=True)
    assert t.add(_ids("abENDcd")) == "abEND"
    assert t.stopped


def test_stop_token_text_is_left_out_unless_included() -> None:
    t = TextStream(CharTokenizer(), [])
    assert t.add(_ids("ab;"), final=True, stop_token=True) == "ab"
    t = TextStream(CharTokenizer(), [], include_stop=True)
    assert t.add(_ids("ab;"), final=True, stop_token=True) == "ab;"


def test_an_incomplete_character_is_never_output() -> None:
    t = TextStream(CharTokenizer(), [])
    assert t.add(_ids("ab\ufffd")) == "ab"
    assert t.add([], final=True) == ""  # vLLM leaves an unfinished character out too


def test_tokens_are_kept_up_to_the_one_completing_the_stop() -> None:
    t = TextStream(CharTokenizer(), ["XY"])
    assert t.add(_ids("aX")) == "a" and t.kept == 2
    assert t.add(_ids("YbXYc"), final=True) == "" and t.stopped
    assert t.kept == 1  # only "Y" completes it: "bXYc" were verified in the same step, not output


def test_a_broken_character_before_a_stop_sequence_is_final() -> None:
    t = TextStream(CharTokenizer(), ["4"])
    assert t.add(_ids("a\ufffd")) == "a"
    assert t.add(_ids("4b"), final=True) == "\ufffd"  # followed by text: final, as vLLM outputs it
