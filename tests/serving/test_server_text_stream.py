"""`TextStream`: token-by-token text equals the whole decode, a character split over tokens is never sent half, and
a stop string split over tokens is caught, with nothing of it sent."""

from hf_pagedkv.serving.server.text_stream import TextStream
from tests.serving.server_helpers import model_and_tokenizer, tiny_single_thread  # noqa: F401

TEXT = "The caf\u00e9 by the river \u2603 sells snow cones; the end."


def pieces(stream: TextStream, ids: list[int]) -> list[str]:
    out = [stream.push([t]) for t in ids]
    return out + [stream.finish()]


def test_pieces_join_to_the_whole_decode_and_never_split_a_character():
    _, tokenizer = model_and_tokenizer()
    ids = tokenizer(TEXT).input_ids
    assert len(ids) > len(TEXT.split())  # the byte-level BPE splits the multi-byte characters
    got = pieces(TextStream(tokenizer, []), ids)
    assert "".join(got) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in p for p in got)


def test_a_stop_string_over_several_tokens_ends_the_text_before_it():
    _, tokenizer = model_and_tokenizer()
    ids = tokenizer(TEXT).input_ids
    for stop, expected in (("river \u2603", "The caf\u00e9 by the "),
                           ("snow", "The caf\u00e9 by the river \u2603 sells "), ("e", "Th"), ("not there", TEXT)):
        stream = TextStream(tokenizer, [stop, "zzzz"])
        got = pieces(stream, ids)
        assert "".join(got) == expected and stream.stopped == (stop != "not there")
        if stream.stopped:
            assert stream.push([ids[0]]) == ""  # nothing after the stop


def test_a_character_cut_off_by_the_end_of_the_choice_is_dropped_not_sent_as_u_fffd():
    _, tokenizer = model_and_tokenizer()
    ids = tokenizer(TEXT).input_ids
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))  # inside a character
    got = pieces(TextStream(tokenizer, []), ids[:cut])
    whole = tokenizer.decode(ids[:cut])
    assert "".join(got) == whole.rstrip("\ufffd") and whole.endswith("\ufffd") and "\ufffd" not in "".join(got)
