"""Fetching a vision model's http(s) images (frontend/images.py ``ImageFetcher`` under ``FetchRules``), from a
local aiohttp server (llmbus.testing.image_server): redirects, the size cap, TGI's error texts, a timeout;
``--allowed-media-domains`` (vLLM's flag), which limits the hosts, every redirect's target included, before
any of them is asked; and both flags, declared once by the frontend and passed on by `llmbus up`."""

from __future__ import annotations

import asyncio
import base64

import pytest
from click.testing import CliRunner

from llmbus.frontend.__main__ import from_args
from llmbus.frontend.errors import ApiError
from llmbus.frontend.images import FetchRules, ImageFetcher
from llmbus.testing.fake_scheduler import WAIT, Frontend
from llmbus.testing.image_server import ImageServer
from llmbus.testing.llava import encoded_image

PNG = encoded_image(0)
JPEG = encoded_image(1, (40, 30), "JPEG")


def validation_text(call) -> str:
    """The detail of the validation error ``call()`` raises."""
    with pytest.raises(ApiError) as raised:
        call()
    assert raised.value.status == 422 and raised.value.error_type == "validation"
    return raised.value.message.removeprefix("Input validation error: ")


@pytest.fixture(scope="module")
def server():
    srv = ImageServer(PNG, JPEG)
    yield srv
    srv.close()


def fetch(url: str, max_bytes: int = 1 << 20, timeout_s: float = WAIT, allowed: tuple[str, ...] = ()) -> bytes:
    async def run():
        async with ImageFetcher(FetchRules.of(max_bytes, allowed, timeout_s)) as fetcher:
            return await fetcher.fetch(url)
    return asyncio.run(run())


def test_fetches_an_image_and_follows_redirects(server):
    assert fetch(server.url + "/img.png") == PNG
    assert fetch(server.url + "/moved") == PNG


def test_the_size_cap_reads_no_further(server):
    # announced: refused by its Content-Length; unannounced and endless: refused once past the cap (TGI's
    # reader stops at cap + 1 bytes, and says so)
    assert validation_text(lambda: fetch(server.url + "/img.png", max_bytes=100)) == (
        f"Image size {len(PNG)} bytes exceeds maximum allowed size of 100 bytes")
    assert validation_text(lambda: fetch(server.url + "/endless", max_bytes=100_000)) == (
        "Image size 100001 bytes exceeds maximum allowed size of 100000 bytes")
    assert fetch(server.url + "/img.png", max_bytes=len(PNG)) == PNG  # the cap itself is allowed


def test_fetch_errors(server):
    assert validation_text(lambda: fetch(server.url + "/nothing.png")) == (
        f"Could not fetch image: HTTP status 404 Not Found for url ({server.url}/nothing.png)")
    gone = ImageServer(PNG, JPEG)
    gone.close()
    assert validation_text(lambda: fetch(gone.url + "/img.png")).startswith("Could not fetch image: Cannot connect")
    assert validation_text(lambda: fetch("http://[::1/img.png")).startswith("Could not fetch image: ")


def test_a_fetch_that_never_answers_times_out(server):
    assert validation_text(lambda: fetch(server.url + "/hang", timeout_s=0.2)) == (
        f"Could not fetch image: no answer within 0.2 s from {server.url}/hang")

def test_a_loop_of_redirects_ends(server):
    assert validation_text(lambda: fetch(server.url + "/loop")) == (
        f"Could not fetch image: more than 10 redirects from {server.url}/loop")


# ------------------------------------------------------------------------------------------------
# --allowed-media-domains
# ------------------------------------------------------------------------------------------------


def test_only_the_allowed_hosts_are_asked(server):
    before = dict(server.hosts)
    assert fetch(server.url + "/img.png", allowed=("127.0.0.1", "example.com")) == PNG
    assert fetch(server.url.replace("127.0.0.1", "LOCALHOST") + "/img.png", allowed=("localhost.",)) == PNG
    assert validation_text(lambda: fetch(server.url + "/img.jpg", allowed=("localhost",))) == (
        "Could not fetch image: '127.0.0.1' is not one of the server's allowed media domains")
    assert server.hosts.get(("127.0.0.1", "/img.jpg"), 0) == before.get(("127.0.0.1", "/img.jpg"), 0)


def test_a_redirect_to_a_host_not_allowed_is_not_followed(server):
    """/away answers with a redirect to `localhost`: allowed, it is followed; not allowed, it is refused
    before it is asked."""
    assert fetch(server.url + "/away", allowed=("127.0.0.1", "localhost")) == PNG
    before = server.hosts.get(("localhost", "/img.png"), 0)
    assert validation_text(lambda: fetch(server.url + "/away", allowed=("127.0.0.1",))) == (
        "Could not fetch image: 'localhost' is not one of the server's allowed media domains")
    assert server.hosts.get(("localhost", "/img.png"), 0) == before
    assert fetch(server.url + "/away") == PNG  # no list: any host, as TGI


def test_a_served_prompt_fetches_only_from_the_allowed_hosts(tiny_llava_dir, server):
    frontend = Frontend(tiny_llava_dir, max_input_tokens=200, max_total_tokens=256,
                        allowed_media_domains=["images.example"])
    try:
        status, _, body = frontend.post("/generate", {"inputs": f"what ![]({server.url}/img.jpg)",
                                                      "parameters": {"max_new_tokens": 5}})
        assert (status, body["error_type"]) == (422, "validation")
        assert body["error"] == ("Input validation error: Could not fetch image: '127.0.0.1' is not one of the "
                                 "server's allowed media domains")
        data = "data:image/png;base64," + base64.b64encode(PNG).decode()
        status, _, body = frontend.post("/generate", {"inputs": f"what ![]({data})",
                                                      "parameters": {"max_new_tokens": 5}})
        assert status == 200, body  # a data URL is no fetch
    finally:
        frontend.close()


# ------------------------------------------------------------------------------------------------
# --max-image-fetch-size and --allowed-media-domains: declared once, by the frontend; `llmbus up` passes them on
# ------------------------------------------------------------------------------------------------


def test_max_image_fetch_size_flag(tmp_path, monkeypatch):
    argv = ["--model-dir", str(tmp_path), "--requests-endpoint", "ipc://r", "--events-endpoint", "ipc://e"]
    assert from_args(argv)[0].max_image_fetch_size == 1073741824  # TGI's default
    assert from_args([*argv, "--max-image-fetch-size", "77"])[0].max_image_fetch_size == 77
    monkeypatch.setenv("MAX_IMAGE_FETCH_SIZE", "123")
    config = from_args(argv)[0]
    assert config.max_image_fetch_size == 123 and "--max-image-fetch-size" in config.to_argv()


def test_up_passes_max_image_fetch_size_to_the_frontend(tiny_llava_dir, tmp_path):
    from llmbus.supervisor.cli import main

    result = CliRunner().invoke(main, ["procfile", "--model-id", str(tiny_llava_dir), "-o", str(tmp_path),
                                       "--max-image-fetch-size", "4096", "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    entries = dict(line.split(": ", 1) for line in (tmp_path / "Procfile").read_text().splitlines()
                   if not line.startswith("#"))
    assert "--max-image-fetch-size 4096" in entries["frontend"]
    assert "--max-image-fetch-size" not in entries["scheduler"] + entries["workers"]


def test_allowed_media_domains_flag(tmp_path):
    argv = ["--model-dir", str(tmp_path), "--requests-endpoint", "ipc://r", "--events-endpoint", "ipc://e"]
    assert from_args(argv)[0].allowed_media_domains == []
    config = from_args([*argv, "--allowed-media-domains", "a.example", "--allowed-media-domains", "b.example"])[0]
    assert config.allowed_media_domains == ["a.example", "b.example"]
    argv_out = config.to_argv()
    assert from_args(argv_out)[0].allowed_media_domains == ["a.example", "b.example"]


def test_up_passes_allowed_media_domains_to_the_frontend(tiny_llava_dir, tmp_path):
    from llmbus.supervisor.cli import main

    result = CliRunner().invoke(main, ["procfile", "--model-id", str(tiny_llava_dir), "-o", str(tmp_path),
                                       "--allowed-media-domains", "a.example", "--allowed-media-domains",
                                       "b.example", "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    entries = dict(line.split(": ", 1) for line in (tmp_path / "Procfile").read_text().splitlines()
                   if not line.startswith("#"))
    assert "--allowed-media-domains a.example --allowed-media-domains b.example" in entries["frontend"]
    assert "--allowed-media-domains" not in entries["scheduler"] + entries["workers"]
