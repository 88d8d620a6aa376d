"""Requests: the sampling fields (``sampling_fields.py``), prompts, structured output, request keys, the prepare step (tokenize, one request struct per row) and error rows (``errors.py``)."""
