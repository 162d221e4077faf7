"""API keys: who may call, and who owns what.

Needs: the keys the command was given (`--api-key`, `--api-keys FILE`). Does: checks each
request's `Authorization: Bearer KEY` against them in constant time and names its owner, a
hash of the key (keys themselves are never stored). Guarantees: with no keys configured
every caller is the one anonymous owner ""; with keys, a request without a known key gets
401 and a key sees only the objects its owner created.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from moecc.serve.errors import APIError


def owner_of(key: str) -> str:
    """The owner id stored with a key's objects: 16 hex digits of its sha256."""
    return hashlib.sha256(b"moecc.serve.key\x00" + key.encode("utf-8")).hexdigest()[:16]


def read_keys_file(path: Path) -> list[str]:
    """The keys in `path`, one a line (blank lines and lines starting with # skipped);
    ValueError naming the file when it cannot be read or holds none."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-keys {path}: cannot read it ({e}); give a UTF-8 file with one key a line") from None
    keys = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not keys:
        raise ValueError(f"--api-keys {path}: holds no key; put one key a line")
    return keys


class Auth:
    """The configured keys (none: no authentication)."""

    def __init__(self, keys: list[str]) -> None:
        for k in keys:
            if len(k) < 8 or any(c.isspace() for c in k):
                raise ValueError("--api-key: each key must be at least 8 characters with no spaces")
        self._keys = [k.encode("utf-8") for k in dict.fromkeys(keys)]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def owner(self, authorization: str | None, cookie_key: str | None = None) -> str:
        """The owner of a request with this Authorization header (or, for the status page, a
        key from its cookie); APIError 401 when keys are configured and none matches."""
        if not self._keys:
            return ""
        key = None
        if authorization is not None:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                key = value.strip()
        if key is None:
            key = cookie_key
        if key is None:
            raise APIError(401, "You didn't provide an API key. You need to provide your API key in an "
                                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                           code="missing_api_key")
        given = key.encode("utf-8")
        matched = False
        for k in self._keys:  # every key compared: no early exit to time
            matched |= hmac.compare_digest(k, given)
        if not matched:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return owner_of(key)
