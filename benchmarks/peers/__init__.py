"""The CPU peers batchmlx is measured against (issues 23 and 28): llama.cpp's `llama-server`,
OpenVINO GenAI's `LLMPipeline` and vLLM's CPU build, each installed once into a cache folder
outside the repository (`setup.py`), fed the same weights (`models.py`) and timed as a whole
process (`run_peer.py`). Never run by CI or the tests."""
