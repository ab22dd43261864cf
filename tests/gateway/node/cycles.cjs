// The official TypeScript SDK client (npm @modelcontextprotocol/sdk) connecting to /mcp and closing again,
// COUNT times with one token, as an ordinary agent run does: close() ends the client without an HTTP DELETE.
// Usage: node cycles.cjs URL TOKEN COUNT; prints one JSON line {"ok": N, "failed": [...], "tools": N}.
const { Client } = require("@modelcontextprotocol/sdk/client/index.js");
const { StreamableHTTPClientTransport } = require("@modelcontextprotocol/sdk/client/streamableHttp.js");

async function main() {
  const [url, token, count] = process.argv.slice(2);
  let ok = 0;
  let tools = 0;
  const failed = [];
  for (let i = 0; i < Number(count); i++) {
    const transport = new StreamableHTTPClientTransport(new URL(url), {
      requestInit: { headers: { Authorization: `Bearer ${token}` } },
    });
    const client = new Client({ name: "cycles", version: "1.0.0" });
    try {
      await client.connect(transport);
      tools = (await client.listTools()).tools.length;
      ok += 1;
    } catch (err) {
      failed.push(`${i}: ${err && err.message ? err.message : err}`);
    } finally {
      await client.close();
    }
  }
  console.log(JSON.stringify({ ok, failed, tools }));
}

main().catch((err) => { console.error(err); process.exit(1); });
