"""Images in a vision-language model's prompts, as TGI's router takes them: each ``![](<url>)`` of the text
(TGI's pattern ``!\\[\\]\\([^\\)]*\\)``) is an image, fetched (``http://``, ``https://``) or decoded (a base64
``data:`` URL), checked to decode as an image, and replaced by the model's image token repeated as many
times as the image takes (vision_models.py). The tokenized prompt's runs of that token are where the images
go: ``m.ImageInput``s with the file's bytes, which the ranks decode and process themselves (the frontend
never runs transformers' image processors, which import torch). A model that marks where an image begins and
ends (Qwen2-VL's ``<|vision_start|>``, ``<|vision_end|>``) has its placeholders between those marks, as TGI's
router writes them; marks already there (a chat template writes them around the image token) are not doubled.

TGI's texts are the errors' (422 ``Input validation error: ...``): "base64 encoding is invalid",
"invalid image", "invalid image content", "Could not fetch image", "Image size {n} bytes exceeds maximum
allowed size of {m} bytes". Beyond TGI: a fetch that answers an HTTP error status is refused as a fetch
error (TGI decodes the error page and fails on it); an image over Pillow's ``MAX_IMAGE_PIXELS`` is an
invalid image (a decompression bomb); the image token written in the text itself, and a ``truncate`` that
would cut into an image, are refused (TGI leaves both to its shards).

A text model reads ``![](...)`` as text, as TGI does.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import re
import warnings
from concurrent.futures import Executor
from dataclasses import dataclass
from io import BytesIO

import aiohttp
from PIL import Image
from yarl import URL

from llmbus.bus import messages as m
from llmbus.frontend.errors import validation_error
from llmbus.frontend.vision_models import VisionSpec

MARKDOWN_IMAGE = re.compile(r"!\[\]\([^)]*\)")
# TGI's router fetches with reqwest's blocking client, whose whole request times out after 30 s
FETCH_TIMEOUT_S = 30.0
FETCH_CHUNK_BYTES = 64 * 1024
MAX_REDIRECTS = 10  # reqwest's default, and aiohttp's
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
ECHOED_CHARS = 120  # of a reference echoed in its error: a bad data URL may be megabytes long
# the declared types TGI decodes as that format (any other is guessed from the bytes), as Pillow names them
_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/gif": "GIF",
            "image/webp": "WEBP", "image/tiff": "TIFF"}


@dataclass(frozen=True)
class LoadedImage:
    """An image of a prompt: the file as fetched or decoded, its size, and its blake2b digest."""

    data: bytes
    width: int
    height: int
    digest: bytes


def refuse_decompression_bombs() -> None:
    """Pillow's ``Image.open`` only warns of an image between ``MAX_IMAGE_PIXELS`` and twice that (a larger one
    raises): made an error, so the frontend logs no warning for what ``check_image`` refuses anyway (it checks
    the size itself too, for a process whose filters were reset)."""
    warnings.simplefilter("error", Image.DecompressionBombWarning)


def markdown_image(url: str) -> str:
    """An image of a chat message as TGI writes it in the message's text, for validation to load: ``![](<url>)``.
    A ``)`` would end the reference early; escaped, it names the same URL."""
    return f"![]({url.replace(')', '%29')})"


def _echo(text: str) -> str:
    return text if len(text) <= ECHOED_CHARS else text[:ECHOED_CHARS] + "..."


def too_large(size: int, limit: int):
    return validation_error(f"Image size {size} bytes exceeds maximum allowed size of {limit} bytes")


def decode_data_url(url: str) -> tuple[bytes, str]:
    """The bytes and the declared type of ``data:<type>;base64,<data>``, as TGI reads one: exactly one ``;``,
    then standard base64 with its padding."""
    content = url[len("data:"):]
    parts = content.split(";")
    if len(parts) != 2:
        raise validation_error(f"invalid image content: {_echo(content)}")
    mimetype, payload = parts
    if not payload.startswith("base64,"):
        raise validation_error(f"invalid image content: {_echo(payload)}")
    try:
        return base64.b64decode(payload[len("base64,"):], validate=True), mimetype
    except (binascii.Error, ValueError) as e:
        raise validation_error(f"base64 encoding is invalid: {e}") from None


def check_image(data: bytes, mimetype: str | None = None) -> tuple[int, int]:
    """(width, height) of an image file that decodes whole, as the ``mimetype`` it declares where TGI knows
    that type, else as whatever its bytes say. Decodes: run it off the event loop."""
    fmt = _FORMATS.get(mimetype or "")
    try:
        with Image.open(BytesIO(data), formats=[fmt] if fmt else None) as image:
            width, height = image.size
            limit = Image.MAX_IMAGE_PIXELS
            if limit and width * height > limit:
                raise Image.DecompressionBombError("")
            image.load()  # the whole file: a truncated or corrupt one fails here, not on the ranks
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise validation_error(f"invalid image: more than {Image.MAX_IMAGE_PIXELS} pixels (a possible "
                               f"decompression bomb)") from None
    except Image.UnidentifiedImageError:
        reason = f"the data is not a {fmt} image ({mimetype})" if fmt else "The image format could not be determined"
        raise validation_error(f"invalid image: {reason}") from None
    except Exception as e:  # noqa: BLE001 - whatever a decoder raises on bad bytes is the image's fault
        raise validation_error(f"invalid image: {e or type(e).__name__}") from None
    return width, height


@dataclass(frozen=True)
class FetchRules:
    """What an ``http(s)`` image fetch may do: read up to ``max_bytes`` (``--max-image-fetch-size``) within
    ``timeout_s``, from any host, or from the ``allowed_hosts`` alone (``--allowed-media-domains``; empty:
    any, as TGI), every redirect's target included."""

    max_bytes: int = 1 << 30
    timeout_s: float = FETCH_TIMEOUT_S
    allowed_hosts: frozenset[str] = frozenset()

    @classmethod
    def of(cls, max_bytes: int, allowed_domains=(), timeout_s: float = FETCH_TIMEOUT_S) -> "FetchRules":
        return cls(max_bytes, timeout_s, frozenset(domain.lower().rstrip(".") for domain in allowed_domains))

    def check_host(self, url: URL) -> None:
        host = (url.host or "").lower().rstrip(".")
        if self.allowed_hosts and host not in self.allowed_hosts:
            raise validation_error(f"Could not fetch image: {host or _echo(str(url))!r} is not one of the server's "
                                   f"allowed media domains")


class ImageFetcher:
    """GETs of a request's ``http(s)`` images over one client session (``async with``) under ``FetchRules``:
    redirects followed (each target's host checked before it is asked), the environment's proxies taken
    (as TGI's reqwest does), each whole fetch under the rules' timeout, and the body's size capped as it
    arrives (a larger one is never held whole)."""

    def __init__(self, rules: FetchRules):
        self.rules = rules
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "ImageFetcher":
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, url: str) -> bytes:
        if self._session is None:
            self._session = aiohttp.ClientSession(trust_env=True)
        try:
            async with asyncio.timeout(self.rules.timeout_s):  # the redirects' hops together
                return await self._follow(URL(url))
        except TimeoutError:
            raise validation_error(f"Could not fetch image: no answer within {self.rules.timeout_s:g} s from "
                                   f"{_echo(url)}") from None
        except (aiohttp.ClientError, ValueError) as e:  # yarl's ValueError: a URL it cannot read
            raise validation_error(f"Could not fetch image: {e or type(e).__name__}") from None

    async def _follow(self, url: URL) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            self.rules.check_host(url)
            async with self._session.get(url, allow_redirects=False) as resp:
                location = resp.headers.get("Location")
                if resp.status in REDIRECT_STATUSES and location:
                    url = resp.url.join(URL(location))
                    continue
                return await self._body(resp, url)
        raise validation_error(f"Could not fetch image: more than {MAX_REDIRECTS} redirects from {_echo(str(url))}")

    async def _body(self, resp: aiohttp.ClientResponse, url: URL) -> bytes:
        max_bytes = self.rules.max_bytes
        if not 200 <= resp.status < 300:
            raise validation_error(f"Could not fetch image: HTTP status {resp.status} {resp.reason} "
                                   f"for url ({_echo(str(url))})")
        if resp.content_length is not None and resp.content_length > max_bytes:
            raise too_large(resp.content_length, max_bytes)
        data = bytearray()
        async for chunk in resp.content.iter_chunked(FETCH_CHUNK_BYTES):
            data += chunk
            if len(data) > max_bytes:
                raise too_large(max_bytes + 1, max_bytes)  # what TGI reads before it stops
        return bytes(data)


def _read_image(data: bytes, mimetype: str | None) -> LoadedImage:
    width, height = check_image(data, mimetype)
    return LoadedImage(data, width, height, hashlib.blake2b(data, digest_size=m.IMAGE_DIGEST_BYTES).digest())


def _decode_and_read(url: str) -> LoadedImage:
    return _read_image(*decode_data_url(url))


def placeholder_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of ``token_id`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    start, end = 0, len(ids)
    while True:
        try:
            start = ids.index(token_id, start)
        except ValueError:
            return runs
        stop = start + 1
        while stop < end and ids[stop] == token_id:
            stop += 1
        runs.append((start, stop - start))
        start = stop


class PromptImages:
    """A vision model's side of preparing a prompt: ``expand`` its text, then ``place`` the images in its
    tokens. ``executor``: where images are decoded (the generator's tokenizing threads)."""

    def __init__(self, spec: VisionSpec, fetch_rules: FetchRules, executor: Executor):
        refuse_decompression_bombs()
        self.spec = spec
        self.fetch_rules = fetch_rules
        self._executor = executor

    async def expand(self, text: str, max_input_tokens: int,
                     loaded: dict[str, LoadedImage] | None = None) -> tuple[str, list[LoadedImage]]:
        """``text`` with each image's reference replaced by its placeholder tokens' text, and its images in
        order. ``loaded``: images already loaded by reference (the other choices of one request), added to."""
        refs = [match.group() for match in MARKDOWN_IMAGE.finditer(text)]
        if not refs:
            return text, []
        start, end = self.spec.image_start, self.spec.image_end
        fewest = len(refs) * (self.spec.tokens_per_image + bool(start) + bool(end))
        if fewest > max_input_tokens:  # refused before any fetch: the prompt can never fit
            raise validation_error(f"`inputs` holds {len(refs)} images, which take at least {fewest} tokens: "
                                   f"`inputs` must have less than {max_input_tokens} tokens")
        loaded = {} if loaded is None else loaded
        missing = list(dict.fromkeys(ref for ref in refs if ref not in loaded))
        if missing:
            loaded.update(zip(missing, await self._load_all(missing)))
        images = [loaded[ref] for ref in refs]
        pieces = MARKDOWN_IMAGE.split(text)
        out = [pieces[0]]
        for before, image, after in zip(pieces, images, pieces[1:]):
            # a chat template that reads content parts wrote the marks around the image token that became this
            # reference (as transformers' processor expects them): the model reads each mark once
            out += ["" if before.endswith(start) else start,
                    self.spec.image_token * self.spec.tokens_for(image.width, image.height),
                    "" if after.startswith(end) else end, after]
        return "".join(out), images

    async def _load_all(self, refs: list[str]) -> list[LoadedImage]:
        """Each reference's image, loaded concurrently; the first failure stops the others, and of the
        failures the first in prompt order is raised."""
        async with ImageFetcher(self.fetch_rules) as fetcher:
            tasks = [asyncio.ensure_future(self._load(ref, fetcher)) for ref in refs]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            finally:  # the request's own cancellation (its client left) included
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]

    async def _load(self, ref: str, fetcher: ImageFetcher) -> LoadedImage:
        url = ref[len("![]("):-1]
        loop = asyncio.get_running_loop()
        if url.startswith(("http://", "https://")):
            data = await fetcher.fetch(url)
            return await loop.run_in_executor(self._executor, _read_image, data, None)
        if url.startswith("data:"):
            return await loop.run_in_executor(self._executor, _decode_and_read, url)
        raise validation_error(f"invalid image content: {_echo(ref)}")

    def place(self, ids: list[int], images: list[LoadedImage], cut: int) -> list[m.ImageInput]:
        """The ``ImageInput`` of each image, from the placeholder tokens of the prompt's ``ids``, of which
        truncation drops the first ``cut``: offsets are in what is left. Each image's placeholders must be
        where its text put them, whole, and no image token be anywhere else (adjacent images' runs touch)."""
        token, token_id = self.spec.image_token, self.spec.image_token_id
        runs = placeholder_runs(ids, token_id)
        counts = [self.spec.tokens_for(image.width, image.height) for image in images]
        spans, run = [], iter(runs)
        start, left = 0, 0
        for count in counts:
            if left == 0:
                start, left = next(run, (0, 0))
            if left < count:
                break
            spans.append((start, count))
            start, left = start + count, left - count
        if len(spans) != len(images) or left or next(run, None) is not None:
            found = sum(length for _, length in runs)
            raise validation_error(
                f"the prompt holds {found} image tokens ({token}) where its images take {sum(counts)}: an "
                f"image is written ![](<url>), and the image token may not appear otherwise")
        total = sum(len(image.data) for image in images)
        if total > m.MAX_IMAGE_BYTES:  # the bus carries a request's images whole, in one message
            raise validation_error(f"a request's images must be at most {m.MAX_IMAGE_BYTES} bytes together. "
                                   f"Given: {total} bytes in {len(images)} images")
        # the mark before an image's placeholders (expand wrote it, or found it there) is the image's too
        first = spans[0][0] - bool(self.spec.image_start) if spans else None
        if first is not None and first < cut:
            raise validation_error(f"`truncate` would cut into an image: the prompt's last {len(ids) - cut} "
                                   f"tokens are kept, and its first image begins {len(ids) - first} "
                                   f"tokens from its end")
        grids = [self.spec.grid_for(image.width, image.height) for image in images]
        return [m.ImageInput(offset=start - cut, num_tokens=count, data=image.data, digest=image.digest,
                             grid=list(grid) if grid is not None else [])
                for (start, count), image, grid in zip(spans, images, grids)]
