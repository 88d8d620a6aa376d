"""Rows before the engine from the job's inputs: discovery, formats (Parquet, JSONL, OpenAI batch), staging, the read tasks, id checks and the job's per-sample rows (``preprocess.py``)."""
