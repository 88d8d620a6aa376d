"""Filesystems and URIs, the output lease, model files and the model download cache."""
