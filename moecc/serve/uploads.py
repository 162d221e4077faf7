"""`POST /v1/files`: a multipart upload streamed to disk under a size limit.

Needs: the request's body stream and a `Blobs`. Does: parses multipart/form-data as it
arrives (python-multipart's streaming parser), writing the `file` part straight into a
temporary file and keeping the small fields (`purpose`, ...) in memory. Guarantees: an
upload over `limit` bytes is refused with 413 as soon as it passes the limit (or at once
from its Content-Length), and its temporary file is removed; nothing is published here
(the caller commits the file and inserts its row only after every check passed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from moecc.serve.blobs import Blobs
from moecc.serve.errors import APIError

_FIELD_LIMIT = 64 * 1024  # bytes of all small form fields together
_SLACK = 64 * 1024  # Content-Length allowed beyond the limit: the multipart framing and fields


@dataclass
class Upload:
    """An upload received: its fields, the file part's name, size and temporary path."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    size: int = 0
    tmp: Path | None = None

    def discard(self) -> None:
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
            self.tmp = None


class _Parts:
    """The parser's callbacks: one part's headers, then its data to a file or a field."""

    def __init__(self, upload: Upload, out: IO[bytes], limit: int) -> None:
        self.upload, self.out, self.limit = upload, out, limit
        self.header_field = b""
        self.header_value = b""
        self.headers: dict[bytes, bytes] = {}
        self.name: str | None = None
        self.is_file = False
        self.value = bytearray()
        self.field_bytes = 0

    def callbacks(self) -> dict[str, Any]:
        return {"on_part_begin": self.part_begin, "on_header_field": self.on_field,
                "on_header_value": self.on_value, "on_header_end": self.header_end,
                "on_headers_finished": self.headers_done, "on_part_data": self.data, "on_part_end": self.part_end}

    def part_begin(self) -> None:
        self.headers, self.name, self.is_file, self.value = {}, None, False, bytearray()

    def on_field(self, data: bytes, start: int, end: int) -> None:
        self.header_field += data[start:end]

    def on_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def header_end(self) -> None:
        self.headers[self.header_field.lower()] = self.header_value
        self.header_field = self.header_value = b""

    def headers_done(self) -> None:
        _, options = parse_options_header(self.headers.get(b"content-disposition", b""))
        self.name = options.get(b"name", b"").decode("utf-8", "replace")
        if self.name == "file":
            if self.upload.filename is not None:
                raise APIError(400, "more than one 'file' part in the upload; send one file", param="file")
            self.is_file = True
            self.upload.filename = options.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")

    def data(self, data: bytes, start: int, end: int) -> None:
        n = end - start
        if self.is_file:
            self.upload.size += n
            if self.upload.size > self.limit:
                raise _too_big(self.limit)
            self.out.write(data[start:end])
        else:
            self.field_bytes += n
            if self.field_bytes > _FIELD_LIMIT:
                raise APIError(400, f"the form's fields other than 'file' exceed {_FIELD_LIMIT} bytes",
                               param=self.name)
            self.value += data[start:end]

    def part_end(self) -> None:
        if not self.is_file and self.name:
            self.upload.fields[self.name] = self.value.decode("utf-8", "replace")


def _too_big(limit: int) -> APIError:
    return APIError(413, f"the file is larger than this server's limit of {limit} bytes (--max-file-size); "
                         f"split it into smaller batches", param="file", code="file_too_large")


async def receive(request: Request, blobs: Blobs, limit: int) -> Upload:
    """The upload in `request` (see the module docstring); APIError for a body that is not
    multipart/form-data with a `file` part, or is too large."""
    ctype, options = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or b"boundary" not in options:
        raise APIError(415 if ctype not in (b"multipart/form-data",) else 400,
                       "POST /v1/files takes multipart/form-data with a 'file' part and a 'purpose' field",
                       param="file")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit + _SLACK:
        raise _too_big(limit)
    upload = Upload()
    with blobs.writing() as (out, tmp):
        upload.tmp = tmp
        parts = _Parts(upload, out, limit)
        parser = MultipartParser(options[b"boundary"], parts.callbacks())  # type: ignore[arg-type]
        try:
            async for chunk in request.stream():
                parser.write(chunk)
            parser.finalize()
        except APIError:
            raise
        except Exception as e:  # the multipart parser's own errors: a malformed body
            raise APIError(400, f"the multipart body could not be parsed: {e}", param="file") from None
    if upload.filename is None:
        upload.discard()
        raise APIError(400, "the upload has no 'file' part; send the JSONL as the form field 'file'", param="file")
    os.chmod(tmp, 0o600)
    return upload
