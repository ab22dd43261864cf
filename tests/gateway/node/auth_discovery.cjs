// The official TypeScript SDK's OAuth discovery (npm @modelcontextprotocol/sdk, client/auth) against /mcp:
// the 401's WWW-Authenticate challenge, then RFC 9728 Protected Resource Metadata, by the pointer and by the
// SDK's own well-known lookup. Usage: node auth_discovery.cjs MCP_URL [BAD_TOKEN]; prints one JSON line.
const { extractWWWAuthenticateParams, discoverOAuthProtectedResourceMetadata } = require(
  "@modelcontextprotocol/sdk/client/auth.js");
const { checkResourceAllowed, resourceUrlFromServerUrl } = require("@modelcontextprotocol/sdk/shared/auth-utils.js");

async function main() {
  const [url, bad] = process.argv.slice(2);
  const init = { jsonrpc: "2.0", id: 1, method: "initialize", params: {
    protocolVersion: "2025-11-25", capabilities: {}, clientInfo: { name: "ts-auth", version: "1" } } };
  const headers = { "Content-Type": "application/json", Accept: "application/json, text/event-stream" };
  if (bad) headers.Authorization = `Bearer ${bad}`;
  const refused = await fetch(url, { method: "POST", headers, body: JSON.stringify(init) });
  const challenge = extractWWWAuthenticateParams(refused);
  await refused.body?.cancel();
  const byPointer = await discoverOAuthProtectedResourceMetadata(url, { resourceMetadataUrl: challenge.resourceMetadataUrl });
  const byWellKnown = await discoverOAuthProtectedResourceMetadata(url);
  const allowed = checkResourceAllowed({ requestedResource: resourceUrlFromServerUrl(new URL(url)),
                                         configuredResource: byPointer.resource });
  console.log(JSON.stringify({ status: refused.status, pointer: challenge.resourceMetadataUrl?.href ?? null,
                               error: challenge.error ?? null, byPointer, byWellKnown, allowed }));
}

main().catch((err) => { console.error(err); process.exit(1); });
