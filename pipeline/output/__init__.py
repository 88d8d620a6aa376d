"""The output directory: parts, their footers, resume from them, and repairs."""
