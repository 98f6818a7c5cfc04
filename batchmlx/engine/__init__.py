"""The only package that imports MLX: model loading, paged KV, the forward step, sampling."""
