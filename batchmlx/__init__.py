"""batchmlx: a local, OpenAI-Batch-compatible job processor for LLM requests on MLX."""

__version__ = "0.1.0"
