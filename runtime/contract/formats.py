"""Stored-format constants the compiler sizes weights by and the runtime decodes them with."""

from __future__ import annotations

#: MXFP4 (OCP microscaling FP4, gpt-oss's experts): values per E8M0 scale, along a stored row.
MXFP4_GROUP = 32
