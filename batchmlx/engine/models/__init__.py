"""Models: resolve a `model` string, fetch the default model, convert GGUF, load through mlx-lm."""
