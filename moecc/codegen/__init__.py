"""Codegen: lower the final graph to the plain-data plan the runtime reads."""
