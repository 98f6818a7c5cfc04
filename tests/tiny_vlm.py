"""A tiny random-weight LLaVA (CLIP vision tower, llama language model) built from mlx-vlm's own
model classes and saved as a local folder mlx-vlm loads: the default model's real tokenizer plus
an `<image>` token, a CLIP image processor at 56x56 pixels (16 patches: 16 placeholder tokens),
and a chat template with image entries. No network, no hub."""

from __future__ import annotations

import json
from pathlib import Path

IMAGE_SIZE, PATCH = 56, 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # "default" strategy: the CLS feature is dropped
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_vlm(
    dest: Path,
    cache: Path,
    seed: int = 0,
    *,
    image_size: int = IMAGE_SIZE,
    hidden: int = 64,
    layers: int = 2,
    vision_hidden: int = 32,
) -> Path:
    """Write the folder `dest`. The keywords scale it (benchmarks/vision_cache.py): an image of
    image_size pixels a side gives (image_size // 14) ** 2 placeholder tokens."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import llava
    from transformers import AutoTokenizer, CLIPImageProcessor

    from tests.tiny_model import build_tiny_model, tokenizer_source

    src = tokenizer_source(cache)
    if not (src / "tokenizer.json").is_file():  # fetched once, as the tiny text model does
        build_tiny_model(dest.parent / "tiny-llama-for-tokenizer", cache)
    tok = AutoTokenizer.from_pretrained(str(src))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = TEMPLATE
    vocab = len(tok)
    text = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": vocab, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
            "tie_word_embeddings": False}  # fmt: skip
    vision = {"model_type": "clip_vision_model", "num_hidden_layers": layers,
              "hidden_size": vision_hidden, "intermediate_size": 2 * vision_hidden,
              "num_attention_heads": 2, "image_size": image_size,
              "patch_size": PATCH, "projection_dim": 32}  # fmt: skip
    config = {"model_type": "llava", "image_token_index": tok.convert_tokens_to_ids("<image>"),
              "vocab_size": vocab, "vision_feature_layer": -2,
              "vision_feature_select_strategy": "default", "text_config": text,
              "vision_config": vision, "eos_token_id": [tok.eos_token_id]}  # fmt: skip
    mx.random.seed(seed)
    args = llava.ModelConfig.from_dict(config)
    args.text_config = llava.TextConfig.from_dict(text)
    args.vision_config = llava.VisionConfig.from_dict(vision)
    model = llava.Model(args)
    dest.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    tok.save_pretrained(str(dest))
    size = {"height": image_size, "width": image_size}
    CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size=size).save_pretrained(dest)
    (dest / "processor_config.json").write_text(json.dumps({
        "patch_size": PATCH, "vision_feature_select_strategy": "default",
        "image_token": "<image>", "num_additional_image_tokens": 1}))  # fmt: skip
    return dest


def png(seed: int, size: tuple[int, int] = (60, 40)) -> bytes:
    """A random RGB picture as PNG bytes."""
    import io

    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


# Qwen2-VL: images and videos at VIDEO_SIZE pixels a side: 4x4 patches merged 2x2 (4 placeholder
# tokens) per image, and per pair of frames (the temporal patch): 8 frames are 16 tokens.
VIDEO_SIZE = 56
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_qwen2_vl(dest: Path, cache: Path, seed: int = 0) -> Path:
    """A random-weight Qwen2-VL folder (mlx-vlm's qwen2_vl classes, M-RoPE), images and videos
    at 56x56 pixels: the default model's tokenizer plus Qwen's vision tokens."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import qwen2_vl
    from transformers import AutoTokenizer

    from tests.tiny_model import build_tiny_model, tokenizer_source

    src = tokenizer_source(cache)
    if not (src / "tokenizer.json").is_file():
        build_tiny_model(dest.parent / "tiny-llama-for-tokenizer", cache)
    tok = AutoTokenizer.from_pretrained(str(src))
    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = QWEN_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in specials}
    hidden = 64
    config = {"model_type": "qwen2_vl", "hidden_size": hidden, "num_hidden_layers": 2,
              "intermediate_size": 2 * hidden, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": len(tok),
              "max_position_embeddings": 4096, "rope_theta": 10000.0,
              "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
              "tie_word_embeddings": False,
              "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
              "vision_start_token_id": ids["<|vision_start|>"],
              "vision_end_token_id": ids["<|vision_end|>"],
              "eos_token_id": [tok.eos_token_id],
              "vision_config": {"model_type": "qwen2_vl", "depth": 2, "embed_dim": 32,
                                "hidden_size": hidden, "num_heads": 2, "patch_size": PATCH,
                                "spatial_patch_size": PATCH, "spatial_merge_size": 2,
                                "temporal_patch_size": 2, "mlp_ratio": 2}}  # fmt: skip
    mx.random.seed(seed)
    args = qwen2_vl.ModelConfig.from_dict(dict(config))
    args.vision_config = qwen2_vl.VisionConfig.from_dict(config["vision_config"])
    args.text_config = qwen2_vl.TextConfig.from_dict(args.text_config)
    model = qwen2_vl.Model(args)
    dest.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    tok.save_pretrained(str(dest))
    pixels = VIDEO_SIZE * VIDEO_SIZE
    processor = {"patch_size": PATCH, "temporal_patch_size": 2, "merge_size": 2,
                 "min_pixels": pixels, "max_pixels": pixels,
                 "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # fmt: skip
    (dest / "preprocessor_config.json").write_text(json.dumps(processor))
    # a video's budget covers all its frames (MAX_VIDEO_FRAMES at VIDEO_SIZE), so none is shrunk
    clip = {**processor, "min_pixels": 28 * 28, "max_pixels": pixels * 128}
    (dest / "video_preprocessor_config.json").write_text(json.dumps(clip))
    return dest


def video(seed: int, frames: int = 8, fps: float = 4.0, size: int = VIDEO_SIZE) -> bytes:
    """A random clip as MJPG-in-AVI bytes, written by PyAV (its wheel's FFmpeg has the encoder)."""
    return encode_video(random_frames(seed, frames, size), fps)


def random_frames(seed: int, frames: int = 8, size: int = VIDEO_SIZE) -> list:
    """`frames` random RGB uint8 frames of size x size (the same for the same seed)."""
    import numpy as np

    rng = np.random.RandomState(seed)
    return [(rng.rand(size, size, 3) * 255).astype("uint8") for _ in range(frames)]


def encode_video(
    frames: list, fps: float = 4.0, container: str = "avi", codec: str = "mjpeg"
) -> bytes:
    """RGB frames encoded by PyAV into a container's bytes (MJPG in AVI unless told)."""
    import io
    from fractions import Fraction

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        for rgb in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        out.mux(stream.encode())  # flush the encoder
    return buf.getvalue()
