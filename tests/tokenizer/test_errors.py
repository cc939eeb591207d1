"""What a RequestError puts on the wire: gRPC refuses metadata that is not printable ASCII
(INTERNAL "Invalid metadata", with a traceback in the tokenizer's log) and clients drop
trailers over 8 KiB (RESOURCE_EXHAUSTED "Stream removed"), while a message can quote the
request and ``Constraint.param`` is whatever a direct client sent."""

from __future__ import annotations

from services.tokenizer.errors import MAX_DETAILS_BYTES, MAX_PARAM_CHARS, RequestError


def test_details_are_cut_to_a_bound_and_say_so():
    short = RequestError("regex: the constraint cannot be used: é")
    assert short.details() == short.message
    long = RequestError("é" * 5000)  # 10,000 bytes of UTF-8
    details = long.details()
    assert details.endswith(" ... (cut, 10000 bytes in all)")
    assert len(details.encode()) <= MAX_DETAILS_BYTES == 2048
    assert details.startswith("é" * 900)


def test_trailing_metadata_is_printable_ascii_and_bounded():
    error = RequestError("x", param="\x00\uffff\U0001f600" + "p" * 300)
    assert error.trailing_metadata() == (
        ("code", "invalid_value"), ("param", ("\\x00\\uffff\\U0001f600" + "p" * 300)[:MAX_PARAM_CHARS]))
    assert RequestError("x", param="messages").trailing_metadata() == (("code", "invalid_value"), ("param", "messages"))
    assert RequestError("x").trailing_metadata() == (("code", "invalid_value"),)
