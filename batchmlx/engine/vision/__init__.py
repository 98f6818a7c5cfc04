"""Vision-language models: prompts with images and videos (prompter.py, video.py) and loading
through mlx-vlm (load.py); their runner is engine/runners/vision.py."""
