"""The Ray Data processor: ``build_orthrus_processor`` and its config."""
