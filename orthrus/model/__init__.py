"""The dual-view Qwen3 model: AR and diffusion attention, KV-cache backends, checkpoint layout."""
from orthrus.model.qwen3 import OrthrusForCausalLM

__all__ = ["OrthrusForCausalLM"]
