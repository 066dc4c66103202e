"""Reading files a user was handed (images, JSONL) with bounded cost and errors that name file and line.

* :func:`open_image_bounded` checks an image's declared size against a pixel limit *before* decoding it
  (PIL's ``Image.open`` reads only the header), so a decompression bomb (a 13,000 x 13,000 PNG of a few
  kilobytes decodes to gigabytes) is refused by name instead of filling memory.
* :func:`iter_jsonl` reads one line at a time with a byte limit per line (a 50 MB line is refused after
  reading the limit, not loaded), splits lines on ``\\n`` only, as JSONL and ``io``'s newline handling do
  (``str.splitlines`` also splits on U+2028, U+2029, U+0085 and form feeds, which are legal inside a JSON
  string), and turns every problem into a :class:`reprlab.errors.DataError` naming ``file:line``,
  including JSON nested too deeply for Python's parser (a ``RecursionError`` otherwise).
* :func:`check_text_length` bounds a caption or prompt with the same kind of message.

[ours] The defaults are generous for research data (40 megapixels: a 7,300 x 5,500 photograph; 1 MiB a
JSONL line) and every reader can pass its own.
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from reprlab.errors import DataError, DataFileMissingError

DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
DEFAULT_MAX_LINE_BYTES = 1 << 20


def open_image_bounded(
    src: bytes | str | Path | IO[bytes],
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    name: str | None = None,
    mode: str | None = None,
) -> Any:
    """Decode an image after checking its declared width x height against ``max_pixels``.

    Args:
        src: the encoded bytes, a path, or a binary file object.
        max_pixels: the largest width x height decoded.
        name: how errors name the source (default: the path, or ``<image bytes>``).
        mode: convert to this PIL mode (``"RGB"``, ``"L"``) after decoding.

    Returns:
        A loaded ``PIL.Image.Image`` (its pixels decoded, its file closed).

    Raises:
        DataError: over the pixel limit (nothing decoded), not an image, truncated or corrupt.
        DataFileMissingError: a path that does not exist.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(src, str | Path):
        name = name or str(src)
        if not Path(src).is_file():
            raise DataFileMissingError(f"image {name} does not exist")
        fh: IO[bytes] = open(src, "rb")  # noqa: SIM115 - closed below
    elif isinstance(src, bytes | bytearray | memoryview):
        name = name or "<image bytes>"
        fh = io.BytesIO(bytes(src))
    else:
        name = name or getattr(src, "name", None) or "<image stream>"
        fh = src
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # checked below, by our limit
            try:
                im = Image.open(fh)
            except Image.DecompressionBombError as err:  # PIL's own hard limit (twice its warning limit)
                raise DataError(f"{name}: image over the pixel limit ({err})") from None
            except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
                raise DataError(f"{name}: not a readable image ({err})") from None
            width, height = im.size
            if width * height > max_pixels:
                raise DataError(
                    f"{name}: image of {width} x {height} = {width * height:,} pixels, over the limit of "
                    f"{max_pixels:,}; it was not decoded",
                    hint="a decompression bomb, or a real image too large for this reader: resize it, or "
                    "raise the reader's pixel limit",
                )
            try:
                im.load()
                if mode is not None and im.mode != mode:
                    im = im.convert(mode)
            except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as err:
                raise DataError(f"{name}: image is truncated or corrupt ({err})") from None
    finally:
        if fh is not src:
            fh.close()
    return im


OnError = Callable[[DataError], None]


def _fail(err: DataError, on_error: OnError | None) -> None:
    if on_error is None:
        raise err
    on_error(err)


def iter_lines(
    path: str | Path, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, on_error: OnError | None = None
) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` for each line of a UTF-8 file, split on ``\\n`` only (``\\r\\n`` too).

    Args:
        on_error: called with the :class:`DataError` of a bad line, which is then skipped (a reader that
            counts and skips bad rows); by default the error is raised.

    Raises:
        DataFileMissingError: no such file.
        DataError: a line longer than ``max_line_bytes`` (found after reading that many bytes, and skipped
            without being held in memory), or bytes that are not UTF-8; both name ``path:line``.
    """
    path = Path(path)
    if not path.is_file():
        raise DataFileMissingError(f"{path} does not exist")
    with open(path, "rb") as fh:
        lineno = 0
        while True:
            raw = fh.readline(max_line_bytes + 2)  # the content, then at most "\r\n"
            if not raw:
                return
            lineno += 1
            body = raw[:-1] if raw.endswith(b"\n") else raw
            body = body[:-1] if body.endswith(b"\r") else body
            if len(body) > max_line_bytes:
                while raw and not raw.endswith(b"\n"):  # the rest of the line, a bounded chunk at a time
                    raw = fh.readline(max_line_bytes)
                _fail(DataError(f"{path}:{lineno}: line longer than {max_line_bytes:,} bytes (the limit for one "
                                "line)", hint="split the record, or check that the file is the JSONL you meant"),
                      on_error)  # fmt: skip
                continue
            if lineno == 1 and body.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
                body = body[3:]
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as err:
                _fail(DataError(f"{path}:{lineno}: not UTF-8 ({err.reason} at byte {err.start} of the line)",
                                hint="save the file as UTF-8"), on_error)  # fmt: skip
                continue
            yield lineno, text


def parse_json_line(text: str, where: str) -> Any:
    """``json.loads`` whose every failure is a :class:`DataError` naming ``where`` (``file:line``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply to parse") from None


def iter_jsonl(
    path: str | Path,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    skip_blank: bool = True,
    on_error: OnError | None = None,
) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` for each JSON line of ``path``; see :func:`iter_lines` for the limits.

    Args:
        on_error: as for :func:`iter_lines`; a line that is not JSON is reported and skipped too.

    Raises:
        DataError: an over-long line, bytes that are not UTF-8, or a line that is not JSON, naming
            ``path:line``.
    """
    for lineno, text in iter_lines(path, max_line_bytes, on_error):
        if skip_blank and not text.strip():
            continue
        try:
            value = parse_json_line(text, f"{path}:{lineno}")
        except DataError as err:
            _fail(err, on_error)
            continue
        yield lineno, value


def check_text_length(text: str, max_chars: int, where: str, what: str = "text") -> str:
    """Return ``text`` if it has at most ``max_chars`` characters, else raise a :class:`DataError`."""
    if len(text) > max_chars:
        raise DataError(f"{where}: {what} of {len(text):,} characters, over the limit of {max_chars:,}")
    return text


__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "DEFAULT_MAX_LINE_BYTES",
    "check_text_length",
    "iter_jsonl",
    "iter_lines",
    "open_image_bounded",
    "parse_json_line",
]
