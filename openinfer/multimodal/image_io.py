"""Reading an image a request names: a base64 ``data:`` URL, or a local file under the one folder the operator
allowed (vLLM's ``--allowed-local-media-path``). Nothing is fetched from the network. Decoding is Pillow's; what
is not an image, or is larger than the limits below, is refused with a ValueError naming the field."""
from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image, UnidentifiedImageError

# Encoded bytes of one image, and its decoded pixels (Pillow's own decompression-bomb guard is 89M pixels; an image
# is resized to at most max_image_tokens anyway, so a bigger one buys nothing but decode time and memory).
MAX_IMAGE_BYTES = 20 << 20
MAX_IMAGE_PIXELS = 40_000_000


def read_image_url(url: object, field: str, allowed_local_media_path: str | None = None) -> Image.Image:
    """The RGB image a ``data:`` URL or a ``file://`` URL (under ``allowed_local_media_path``) holds."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{field} must be a non-empty string (a data: URL, or a file:// URL)")
    if url.startswith("data:"):
        return decode_image(_data_url_bytes(url, field), field)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{field}: a file:// URL names a local path (file:///path), not host {parsed.netloc!r}")
        return decode_image(_local_file_bytes(unquote(parsed.path), field, allowed_local_media_path), field)
    shown = url if len(url) <= 80 else url[:77] + "..."
    raise ValueError(f"{field}: {shown!r} is not a data: URL or a file:// URL; openinfer fetches nothing from the "
                     "network (send the image base64-encoded as data:image/...;base64,...)")


def read_base64_image(data: object, field: str) -> Image.Image:
    """An image sent as bare base64 (Anthropic's ``source: {type: base64, data}``)."""
    if not isinstance(data, str) or not data:
        raise ValueError(f"{field} must be a non-empty base64 string")
    return decode_image(_b64decode(data, field), field)


def _data_url_bytes(url: str, field: str) -> bytes:
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise ValueError(f"{field}: a data: URL needs a ',' before its data")
    params = header.split(";")
    media_type = params[0].strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise ValueError(f"{field}: the data: URL's media type is {media_type!r}, not an image/* type")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise ValueError(f"{field}: the data: URL must be base64-encoded (data:image/png;base64,...)")
    return _b64decode(payload, field)


def _b64decode(payload: str, field: str) -> bytes:
    if len(payload) > (MAX_IMAGE_BYTES * 4) // 3 + 4:
        raise ValueError(f"{field}: the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field}: the image data is not valid base64") from None


def _local_file_bytes(path: str, field: str, allowed: str | None) -> bytes:
    if allowed is None:
        raise ValueError(f"{field}: local files are refused unless the server is started with "
                         "--allowed-local-media-path (a folder the images may be read from)")
    root = Path(allowed).resolve()
    target = Path(path).resolve()  # symlinks resolved: a link out of the folder is outside it
    if os.path.commonpath([root, target]) != str(root):
        raise ValueError(f"{field}: {path!r} is not under --allowed-local-media-path {str(root)!r}")
    if not target.is_file():
        raise ValueError(f"{field}: no file {path!r}")
    if target.stat().st_size > MAX_IMAGE_BYTES:
        raise ValueError(f"{field}: the image is larger than {MAX_IMAGE_BYTES} bytes")
    return target.read_bytes()


def decode_image(data: bytes, field: str) -> Image.Image:
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{field}: the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if w * h > MAX_IMAGE_PIXELS:
                raise ValueError(f"{field}: the image is {w}x{h} pixels, more than {MAX_IMAGE_PIXELS}")
            img.load()
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, SyntaxError) as e:
        raise ValueError(f"{field}: the data is not an image Pillow can decode ({type(e).__name__})") from None
