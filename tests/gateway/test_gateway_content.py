"""An external MCP server's own content items (an image, text around it, a resource link) reach a
gateway client as MCP content, not flattened to one JSON text: a real server and device process with
the real `@modelcontextprotocol/server-everything`, and the official SDK client over /mcp."""

from __future__ import annotations

import asyncio
import base64

from tests.device.test_mcp_resources import alpha, config, everything_bin  # noqa: F401 (fixtures)
from tests.kits.gateway import Seen, mcp_client
from tests.kits.netutil import Cluster


async def test_an_image_reaches_the_client_as_an_image(alpha: Cluster) -> None:  # noqa: F811
    seen = Seen()
    async with mcp_client(f"http://127.0.0.1:{alpha.port}/mcp", alpha.api_token, message_handler=seen) as client:
        # the device registers before its external server has started; its tools join later, announced
        async with asyncio.timeout(60):
            while True:
                seen.list_changed.clear()  # before listing: a change announced meanwhile is not missed
                if "alpha__get-tiny-image" in {t.name for t in (await client.list_tools()).tools}:
                    break
                await seen.list_changed.wait()
        image = await client.call_tool("alpha__get-tiny-image", {})
        assert not image.is_error
        assert [item.type for item in image.content] == ["text", "image", "text"]
        png = image.content[1]
        assert png.mime_type == "image/png" and base64.b64decode(png.data).startswith(b"\x89PNG")
        # as the server sent it: no structured content (the device's envelope is not passed on)
        assert image.structured_content is None

        links = await client.call_tool("alpha__get-resource-links", {"count": 1})
        assert [item.type for item in links.content].count("resource_link") == 1

        # a built-in tool's result is still one JSON text with its structured twin
        info = await client.call_tool("alpha__get_system_info", {})
        assert [item.type for item in info.content] == ["text"] and info.structured_content
