"""Pure domain code: stdlib, dataclasses and pydantic only (a test enforces it)."""
