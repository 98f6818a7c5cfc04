"""Model runners: what differs between models, plugged into the one step loop of engine/core.py.
Each has its scheduling policy and its forward step: paged.py (core/scheduler over the paged KV
pool, on MLX or the host backend), mlx_lm.py (mlx-lm's own batching), vision.py (mlx-vlm)."""
