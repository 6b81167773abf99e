"""A report's markdown as the Prefect UI shows it: its images inline, as data: URIs.

The Prefect UI renders a markdown artifact's images in the browser, which can load neither a
file:// path (an http page may not read local files) nor an s3:// object (a presigned URL would
carry a signature and expire within 7 days). So the artifact keeps a copy of each picture, at
most MAX_IMAGE_BYTES (a larger PNG is shrunk to fit, or left as a link); the store keeps the
original. Used by the flows (a committed report, read from the store) and by a training stage's
child (its report so far, at each in-stage checkpoint).
"""

from __future__ import annotations

import base64
import io
import posixpath
import re
from typing import Callable

MAX_IMAGE_BYTES = 512 * 1024  # an inlined image, before base64 (which adds a third)
MAX_SOURCE_BYTES = 16 * 1024 * 1024  # a bigger file is not even read: it stays a link
MAX_PIXELS = 40_000_000  # a picture with more is not decoded (a small PNG can unpack to gigabytes)
MAX_IMAGES = 8  # inlined per report, each picture once however often it is named
MIN_SIDE = 64  # shrinking stops here: a smaller picture shows nothing
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif",
               ".webp": "image/webp"}
# ![alt](target) or [text](target) whose target has no scheme and is not absolute or an anchor
RELATIVE_LINK = re.compile(r"(!?)(\[[^\]]*\]\()(?![a-zA-Z][a-zA-Z0-9+.-]*:|/|#)([^)\s]+)\)")


def prefect_key(*parts: str) -> str:
    """An artifact key of `parts`: Prefect wants lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def report_key(pipeline: str, stage_id: str) -> str:
    """The key of a stage's report artifact: the report so far and the committed one share it, so
    the UI's latest version of the key is the newest."""
    return prefect_key(pipeline, stage_id, "report")


def inline_images(markdown: str, read: Callable[[str], bytes]) -> str:
    """Each relative image (`![curves](curves.png)`) as a data: URI of `read(target)`'s bytes.

    `read` gets the target as written (normalised, no `..`); an image it cannot read (raises),
    one whose type is not an image's or that cannot be brought under MAX_IMAGE_BYTES stays as
    it was, for the caller to point into the store, as do the pictures past the first MAX_IMAGES
    (a hostile report naming one picture a thousand times gets it inlined once). Links that are
    not images are kept.
    """
    tried: set[str] = set()

    def inline(match: re.Match) -> str:
        bang, opening, target = match.groups()
        if not bang or target in tried or len(tried) >= MAX_IMAGES:
            return match.group(0)
        tried.add(target)
        try:
            uri = image_data_uri(target, read)
        except Exception:  # noqa: BLE001 - a picture that cannot be shown stays a link
            uri = None
        return f"{bang}{opening}{uri})" if uri else match.group(0)

    return RELATIVE_LINK.sub(inline, markdown)


def image_data_uri(target: str, read: Callable[[str], bytes]) -> str | None:
    name = posixpath.normpath(target)
    mime = IMAGE_TYPES.get(posixpath.splitext(name)[1].lower())
    if mime is None or name.startswith("..") or name.startswith("/"):
        return None
    data = read(name)
    if len(data) > MAX_SOURCE_BYTES:
        return None
    if len(data) > MAX_IMAGE_BYTES:
        data, mime = shrink(data, MAX_IMAGE_BYTES), "image/png"
        if data is None:
            return None
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def shrink(data: bytes, limit: int) -> bytes | None:
    """The picture as a PNG of at most `limit` bytes, halving its sides (Pillow, which matplotlib
    brings); None when it would get smaller than MIN_SIDE pixels first."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:  # reads the header only, not the pixels
        if image.width * image.height > MAX_PIXELS:
            return None
        image.load()
        picture = image.convert("RGBA") if image.mode not in ("RGB", "RGBA", "L", "LA") else image.copy()
    while min(picture.size) // 2 >= MIN_SIDE:
        picture = picture.resize((picture.width // 2, picture.height // 2), Image.LANCZOS)
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG", optimize=True)
        if buffer.tell() <= limit:
            return buffer.getvalue()
    return None


def unlink_relative(markdown: str) -> str:
    """Relative links and images as their text only: for a report whose files are not in the
    store (yet), so no link can point at them."""
    def text(match: re.Match) -> str:
        bang, opening, target = match.groups()
        label = opening[1:-2]
        return f"*{label or target}: not shown*" if bang else (label or target)

    return RELATIVE_LINK.sub(text, markdown)
