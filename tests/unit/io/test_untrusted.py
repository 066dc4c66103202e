"""Untrusted files stay bounded: an image's size is checked before it is decoded, JSONL lines are read one
at a time under a byte limit and split on "\\n" only, and every failure names the file (and line)."""

import io
import struct
import zlib

import pytest
from PIL import Image

from reprlab.errors import DataError, DataFileMissingError
from reprlab.io.untrusted import check_text_length, iter_jsonl, iter_lines, open_image_bounded


def _png_header_only(width, height):
    """A PNG that declares ``width`` x ``height`` and holds no pixel data: decoding it would fail, so an error
    about the size proves the size was checked first."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def _png(width, height, mode="RGB"):
    buf = io.BytesIO()
    Image.new(mode, (width, height), (128, 128, 128)).save(buf, format="PNG")
    return buf.getvalue()


def test_a_decompression_bomb_is_refused_before_decoding():
    # 13,000 x 13,000: under PIL's own hard limit (2 x 89.5 M pixels), so only our check stops it
    with pytest.raises(
        DataError,
        match=r"bomb.png: image of 13000 x 13000 = 169,000,000 pixels, over the limit of 40,000,000; it was not decoded",
    ):  # noqa: E501
        open_image_bounded(_png_header_only(13_000, 13_000), name="bomb.png")
    with pytest.raises(DataError, match="over the pixel limit"):  # past PIL's hard limit: its error, renamed
        open_image_bounded(_png_header_only(20_000, 20_000))
    with pytest.raises(DataError, match="100 x 100 = 10,000 pixels, over the limit of 9,999"):
        open_image_bounded(_png(100, 100), max_pixels=9_999)


def test_images_within_the_limit_decode_from_bytes_paths_and_streams(tmp_path):
    data = _png(64, 48)
    (tmp_path / "a.png").write_bytes(data)
    for src in (data, tmp_path / "a.png", str(tmp_path / "a.png"), io.BytesIO(data)):
        im = open_image_bounded(src, max_pixels=64 * 48, mode="L")
        assert im.size == (64, 48) and im.mode == "L" and im.getpixel((0, 0)) == 128


def test_corrupt_truncated_and_missing_images_are_named(tmp_path):
    with pytest.raises(DataError, match=r"x.png: image is truncated or corrupt"):
        open_image_bounded(_png(64, 64)[:-40], name="x.png")
    with pytest.raises(DataError, match=r"<image bytes>: not a readable image"):
        open_image_bounded(b"not an image at all")
    with pytest.raises(DataFileMissingError, match="nope.png does not exist"):
        open_image_bounded(tmp_path / "nope.png")


SEPARATORS = ["\u2028", "\u2029", "\u0085", "\x0c", "\x0b", "\x1c", "\x1d", "\x1e", "\r"]


def test_jsonl_lines_split_on_newline_only(tmp_path):
    """str.splitlines() also splits on these; inside a JSON string they are text (U+2028 is legal JSON)."""
    import json

    rows = [{"text": f"a{sep}b"} for sep in SEPARATORS]
    p = tmp_path / "x.jsonl"
    p.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    assert [obj for _, obj in iter_jsonl(p)] == rows
    assert len(p.read_text(encoding="utf-8").splitlines()) > len(rows)  # the bug this avoids


def test_jsonl_crlf_bom_blank_lines_and_a_last_line_without_newline(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"a": 1}\r\n\r\n  \n{"a": 2}')
    assert list(iter_jsonl(p)) == [(1, {"a": 1}), (4, {"a": 2})]


def test_an_over_long_line_is_an_error_naming_file_and_line_without_reading_it_whole(tmp_path):
    p = tmp_path / "big.jsonl"
    with open(p, "wb") as fh:
        fh.write(b'{"a": 1}\n' + b"[" * 50_000_000 + b"\n")  # 50 MB of "[" (a RecursionError in json)
    with pytest.raises(DataError, match=r"big.jsonl:2: line longer than 1,048,576 bytes"):
        list(iter_jsonl(p))
    ok = tmp_path / "edge.jsonl"
    ok.write_bytes(b'"' + b"x" * 98 + b'"\n' + b'"' + b"x" * 99 + b'"\r\n')  # 100 and 101 bytes
    assert next(iter_lines(ok, max_line_bytes=100)) == (1, '"' + "x" * 98 + '"')
    with pytest.raises(DataError, match=r"edge.jsonl:2: line longer than 100 bytes"):
        list(iter_lines(ok, max_line_bytes=100))


def test_deep_nesting_non_utf8_and_bad_json_are_errors_naming_the_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"a": 1}\n' + b"[" * 500_000 + b"\n")  # within the byte limit, too deep for json
    with pytest.raises(DataError, match=r"x.jsonl:2: JSON nested too deeply"):
        list(iter_jsonl(p))
    p.write_bytes(b'{"a": 1}\n{"a": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"x.jsonl:2: not UTF-8"):
        list(iter_jsonl(p))
    p.write_bytes(b'{"a": 1}\n{"a": }\n')
    with pytest.raises(DataError, match=r"x.jsonl:2: not valid JSON \(Expecting value at column 7\)"):
        list(iter_jsonl(p))
    with pytest.raises(DataFileMissingError):
        list(iter_jsonl(tmp_path / "nope.jsonl"))


def test_text_length_limit():
    assert check_text_length("abc", 3, "f:1") == "abc"
    with pytest.raises(DataError, match="f:2: caption of 4 characters, over the limit of 3"):
        check_text_length("abcd", 3, "f:2", "caption")


def test_a_reader_that_counts_bad_lines_skips_them_and_goes_on(tmp_path):
    """on_error: the table readers' skip-and-count policy; an over-long line is skipped in bounded chunks."""
    p = tmp_path / "mixed.jsonl"
    p.write_bytes(b'{"a": 1}\n' + b"x" * 5000 + b"\n" + b'{"a": caf\xe9}\n' + b"{bad\n" + b'{"a": 2}')
    errors = []
    got = list(iter_jsonl(p, max_line_bytes=100, on_error=errors.append))
    assert got == [(1, {"a": 1}), (5, {"a": 2})]
    assert [str(e).split(": ", 1)[1].split(" (")[0] for e in errors] == [
        "line longer than 100 bytes", "not UTF-8", "not valid JSON"]  # fmt: skip
    assert [str(e).split(": ", 1)[0] for e in errors] == [f"{p}:2", f"{p}:3", f"{p}:4"]
