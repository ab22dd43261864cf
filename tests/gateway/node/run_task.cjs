// The official TypeScript SDK client (npm @modelcontextprotocol/sdk, MCP 2025-11-25 tasks) calling run_task as a
// task: callToolStream sends tools/call with params.task, polls tasks/get, then tasks/result (which asks the task's
// questions through elicitation, answered ANSWER); then tasks/list, and another token's tasks/get.
// Usage: node run_task.cjs URL TOKEN OTHER_TOKEN ARGUMENTS_JSON ANSWER
// Prints one JSON line: {taskSupport, messages, taskId, result, error, asked, notified, listed, otherError}.
const { Client } = require("@modelcontextprotocol/sdk/client/index.js");
const { StreamableHTTPClientTransport } = require("@modelcontextprotocol/sdk/client/streamableHttp.js");
const {
  CallToolResultSchema, ElicitRequestSchema, TaskStatusNotificationSchema,
} = require("@modelcontextprotocol/sdk/types.js");

function transport(url, token) {
  return new StreamableHTTPClientTransport(new URL(url), {
    requestInit: { headers: { Authorization: `Bearer ${token}` } },
  });
}

function within(promise, ms) {
  // (the timer must not keep node running once the promise has settled)
  return Promise.race([promise, new Promise((resolve) => setTimeout(() => resolve("timed out"), ms).unref())]);
}

async function main() {
  const [url, token, otherToken, args, answer] = process.argv.slice(2);
  const client = new Client({ name: "ts-tasks", version: "1.0.0" }, { capabilities: { elicitation: { form: {} } } });
  const out = { messages: [], asked: [], notified: [] };
  let ended;
  const end = new Promise((resolve) => { ended = resolve; });
  client.setNotificationHandler(TaskStatusNotificationSchema, (n) => {
    out.notified.push(n.params.status);
    if (["completed", "failed", "cancelled"].includes(n.params.status)) ended("told");
  });
  client.setRequestHandler(ElicitRequestSchema, async (request) => {
    out.asked.push(request.params.message);
    return { action: "accept", content: { answer } };
  });
  const t0 = Date.now();
  await client.connect(transport(url, token));
  out.connected = Date.now() - t0;
  const listed = (await client.listTools()).tools;
  out.listedAt = Date.now() - t0;
  out.taskSupport = (listed.find((t) => t.name === "run_task").execution || {}).taskSupport;
  const stream = client.experimental.tasks.callToolStream(
    { name: "run_task", arguments: JSON.parse(args) }, CallToolResultSchema, { task: { ttl: 600000 } });
  for await (const message of stream) {
    out.messages.push((message.type === "taskStatus" ? `taskStatus:${message.task.status}` : message.type) + `@${Date.now() - t0}`);
    if (message.type === "taskCreated") out.taskId = message.task.taskId;
    if (message.type === "result") out.result = message.result;
    if (message.type === "error") out.error = String(message.error);
  }
  out.end = await within(end, 20000);
  out.t = Date.now() - t0; // the end's status notification, on the session's stream
  out.listed = (await client.experimental.tasks.listTasks()).tasks.map((t) => t.taskId);
  const other = new Client({ name: "ts-other", version: "1.0.0" });
  await other.connect(transport(url, otherToken));
  try {
    await other.experimental.tasks.getTask(out.taskId);
    out.otherError = null;
  } catch (err) {
    out.otherError = err.code;
  }
  await other.close();
  await client.close();
  console.log(JSON.stringify(out));
}

main().catch((err) => { console.error(err); process.exit(1); });
