"""Images in chat requests: OpenAI ``image_url`` content parts and Anthropic ``image`` blocks (mapped onto
``image_url`` parts by anthropic_request.anthropic_messages). Each image becomes the model's image placeholder
token in the message text the chat template renders, and after the template its positions are placed
(multimodal/processor.py). Only ``data:`` URLs and files under ``--allowed-local-media-path`` are read: nothing is
fetched. Every refusal is a 400 naming the field."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PIL import Image

from openinfer.multimodal.image_io import read_image_url
from openinfer.multimodal.image_layout import VisionGeometry
from openinfer.multimodal.processor import expand_prompt
from openinfer.server.errors import APIError
from openinfer.step_io import MMImage


@dataclass(frozen=True)
class ChatImages:
    """What the server needs to take images: the placeholder text, the model's geometry and the limits."""

    placeholder: str
    geometry: VisionGeometry
    limit: int | None
    allowed_local_media_path: str | None

    @classmethod
    def for_engine(cls, model_config: Any, tokenizer: Any) -> ChatImages | None:
        """None when the model takes no images (no vision_config, or --limit-mm-per-prompt '{"image": 0}')."""
        limits = model_config.limit_mm_per_prompt or {}
        if not VisionGeometry.takes_images(model_config.hf_config) or limits.get("image") == 0:
            return None
        geometry = VisionGeometry.from_hf(model_config.hf_config)
        placeholder = tokenizer.convert_ids_to_tokens(geometry.image_token_id)
        return cls(placeholder, geometry, limits.get("image"), model_config.allowed_local_media_path)

    def read(self, url: Any, field: str) -> Image.Image:
        try:
            return read_image_url(url, field, self.allowed_local_media_path)
        except ValueError as e:
            raise APIError(str(e), 400, field.replace("[", ".").replace("]", "")) from None

    def check_count(self, n: int) -> None:
        if self.limit is not None and n > self.limit:
            raise APIError(f"the request has {n} images, more than the {self.limit} allowed per prompt "
                           f"(--limit-mm-per-prompt)", 400, "messages")

    def place(self, ids: list[int], images: list[Image.Image]) -> tuple[list[int], list[MMImage]]:
        try:
            return expand_prompt(ids, images, self.geometry, self.limit)
        except ValueError as e:
            raise APIError(str(e), 400, "messages") from None


def no_images(field: str) -> APIError:
    return APIError(f"{field}: this model takes no image input (openinfer takes images for DeepSeek-V4.1 "
                    f"checkpoints with a vision_config, unless started with --limit-mm-per-prompt "
                    f"'{{\"image\": 0}}')", 400,
                    field.replace("[", ".").replace("]", ""))
