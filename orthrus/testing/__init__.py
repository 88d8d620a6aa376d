"""Tools for tests and benchmarks (not used by the engine): counting host syncs."""
