"""Files that travel between devices: the server-side transfer service (`service`), which drives the devices'
`transfer` tool set chunk by chunk over AIP. See docs/transfer.md."""
