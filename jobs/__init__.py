"""Entry points: thin command-line wrappers over `orthrus` and `pipeline`."""
