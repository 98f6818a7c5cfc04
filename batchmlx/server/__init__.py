"""The OpenAI-compatible HTTP API: Files, Batches, and online completions on the worker's engine.

Starlette on uvicorn; imports no MLX (the in-process worker loads it). `create_app` builds the app,
`serve` runs it.
"""
