"""The transformers reader's image path on a tiny randomly initialised LLaVA built from configs.

No vision-language weights come from a package registry (ENVIRONMENT.md), so this model's answers mean
nothing; what is checked is the plumbing: images reach the processor in order, each becomes exactly
(32 / 8)^2 = 16 image tokens, mixed batches come back in order, and image bytes enter the cache key.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memfit_gpu.config import ReaderConfig
from memfit_gpu.readers.reader import Reader, make_reader
from memfit_gpu.readers.types import Request

# Renders list content (image parts as <image>, then text) the way real VLM chat templates do.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE_TOKENS = (32 // 8) ** 2  # CLIP 32x32 input, 8x8 patches, CLS dropped ("default" strategy)


def build_tiny_llava(out: Path) -> Path:
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.clip import CLIPImageProcessorPil

    from memfit_gpu import models

    tok = AutoTokenizer.from_pretrained(models.resolve("reader", "HuggingFaceTB/SmolLM2-135M-Instruct").path)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=2048,
                       eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(out)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tok, patch_size=8, vision_feature_select_strategy="default", chat_template=TEMPLATE,
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    Image.new("RGB", (40, 30), (200, 30, 30)).save(folder / "red.png")
    Image.new("RGB", (64, 64), (30, 30, 200)).save(folder / "blue.jpg")
    return [str(folder / "red.png"), str(folder / "blue.jpg")]


@pytest.fixture(scope="module")
def vision_reader(tmp_path_factory: pytest.TempPathFactory) -> Reader:
    model_dir = build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))
    reader = make_reader(ReaderConfig(model=str(model_dir), max_new_tokens=4, batch_size=4),
                         tmp_path_factory.mktemp("run"), progress=False)
    yield reader
    reader.close()


@pytest.mark.slow
def test_images_become_image_tokens_in_order(vision_reader: Reader, images: list[str]) -> None:
    assert vision_reader.backend.vision  # type: ignore[attr-defined]
    ask = [{"role": "user", "content": "What is in the picture?"}]
    requests = [Request(ask, "answer", images=[images[0], images[1]], key="two"),
                Request(ask, "answer", key="none"),
                Request(ask, "answer", images=[images[1]], key="one")]
    out = vision_reader.generate(requests)
    text_only = out[1].input_tokens
    assert [r.input_tokens - text_only for r in out] == [2 * IMAGE_TOKENS, 0, IMAGE_TOKENS]
    assert all(1 <= r.output_tokens <= 4 and not r.cached for r in out)


@pytest.mark.slow
def test_image_content_is_part_of_the_cache_key(vision_reader: Reader, images: list[str], tmp_path: Path) -> None:
    import shutil

    ask = [{"role": "user", "content": "Describe it."}]
    copy = tmp_path / "same_red.png"
    shutil.copy(images[0], copy)
    first = vision_reader.generate([Request(ask, "answer", images=[images[0]], key="a")])
    same = vision_reader.generate([Request(ask, "answer", images=[str(copy)], key="b")])
    other = vision_reader.generate([Request(ask, "answer", images=[images[1]], key="c")])
    assert not first[0].cached and same[0].cached and not other[0].cached
    assert same[0].text == first[0].text
    with pytest.raises(FileNotFoundError, match="nowhere.png"):
        vision_reader.generate([Request(ask, "answer", images=[str(tmp_path / "nowhere.png")], key="d")])
