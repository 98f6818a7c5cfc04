"""KV storage: the paged pool and its per-layer cache objects, and the decodes' dense copy."""
