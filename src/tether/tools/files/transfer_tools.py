"""The `transfer` built-in tool set: both halves of a file transfer between devices (see `transfer_send`
and `transfer_receive`), which the server's transfer service drives chunk by chunk over AIP."""

from __future__ import annotations

from tether.tools.files.transfer_receive import transfer_begin, transfer_commit, write_file_chunk
from tether.tools.files.transfer_send import read_file_chunk, transfer_manifest
from tether.tools.runtime import ToolSet


def transfer_toolset() -> ToolSet:
    """A fresh tool set each call (no shared registry)."""
    return ToolSet("transfer", [transfer_manifest, read_file_chunk, transfer_begin, write_file_chunk,
                                transfer_commit],
                   description="send and receive files between devices in checked, resumable chunks")
