"""Rows before the engine: input discovery and reading, request building, error rows, the schema."""
