// The dashboard's admin pages (loaded after app.js, whose h/api/view/status/can/toast it uses): the audit
// log, tokens, the approval inbox, webhooks, and a device's actions (rename, tags, remove, its policy).
// Every string from the server goes into the page as text (h() never parses HTML).
"use strict";

// -- times: relative, with the exact time on hover ------------------------------------------------
function ago(date) {
  const s = Math.round((Date.now() - date.getTime()) / 1000); const a = Math.abs(s);
  const say = (n, unit) => (s >= 0 ? `${n} ${unit} ago` : `in ${n} ${unit}`);
  if (a < 10) return "just now";
  if (a < 60) return say(a, "s");
  if (a < 3600) return say(Math.round(a / 60), "min");
  if (a < 86400) return say(Math.round(a / 3600), "h");
  if (a < 30 * 86400) return say(Math.round(a / 86400), "d");
  return date.toLocaleDateString();
}
// a unix time (seconds) or an ISO string as <time>: "3 min ago", the exact local time in its title
function when(t) {
  if (t === null || t === undefined || t === "") return "—";
  const d = new Date(typeof t === "number" ? t * 1000 : t);
  if (Number.isNaN(d.getTime())) return String(t);
  return h("time", {datetime: d.toISOString(), title: d.toLocaleString(), "data-rel": "1"}, ago(d));
}
setInterval(() => {  // relative times age in place (a redraw of the text only)
  for (const el of document.querySelectorAll("time[data-rel]")) el.textContent = ago(new Date(el.getAttribute("datetime")));
}, 30000);
const empty = (text) => h("p", {class: "empty muted"}, text);

// -- audit ---------------------------------------------------------------------------------------
// plumbing the server drives itself (the tool listing a device page asks for, transfer chunks): hidden by
// default, shown with "meta calls"
const META = new Set(["list_tools", "get_profile", "ping", "transfer_begin", "write_file_chunk", "transfer_commit",
  "transfer_abort", "read_file_chunk", "transfer_manifest"]);
function summarise(args) {
  let a = args;
  if (typeof a === "string") { try { a = JSON.parse(a); } catch (x) { return a.slice(0, 160); } }
  if (a === null || a === undefined) return "";
  if (typeof a !== "object") return String(a).slice(0, 160);
  if (typeof a.cmd === "string") return [a.cmd, ...(Array.isArray(a.argv) ? a.argv : [])].join(" ").slice(0, 160);
  const parts = Object.entries(a).map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`);
  const text = parts.join(" ");
  return text.length > 160 ? `${text.slice(0, 159)}…` : text;
}
function caller(by) {  // api:NAME, task:ID for api:NAME, undo:ID by api:NAME, a person on the screen
  const m = /^(task|undo):(\S+) (?:for|by) (.*)$/.exec(by || "");
  if (m) return h("span", {}, m[3].replace(/^api:/, ""), " ", h("span", {class: "muted"}, `(${m[1]} `,
    h("a", {href: `#/tasks/${encodeURIComponent(m[2])}`}, m[2].slice(0, 8)), ")"));
  return String(by || "—").replace(/^api:/, "");
}
const auditStatus = (s) => status(s === "success" ? "done" : s === "failure" || s === "denied" ? "failed" : s);
async function auditView(params) {
  const draw = drawer();
  const q = new URLSearchParams();
  for (const k of ["device", "task", "token", "since", "until", "before"]) if (params.get(k)) q.set(k, params.get(k));
  q.set("limit", params.get("limit") || "100");
  const meta = params.get("meta") === "1"; const tool = params.get("tool") || ""; const outcome = params.get("status") || "";
  const data = await api(`/api/v1/audit?${q}`);
  const all = Array.isArray(data) ? data : data.rows; const next = Array.isArray(data) ? null : data.next;
  const rows = all.filter((r) => (meta || !META.has(r.tool_name)) && (!tool || String(r.tool_name).includes(tool))
    && (!outcome || r.status === outcome));
  const local = (t) => { if (!t) return ""; const d = new Date(Number(t) * 1000); return new Date(d.getTime() - d.getTimezoneOffset() * 60000).toISOString().slice(0, 16); };
  const form = h("form", {class: "card row", id: "audit-filter", onsubmit: (e) => {
    e.preventDefault(); const p = new URLSearchParams();
    for (const k of ["device", "task", "token", "tool"]) if (form[k].value.trim()) p.set(k, form[k].value.trim());
    if (form.status.value) p.set("status", form.status.value);
    for (const k of ["since", "until"]) if (form[k].value) p.set(k, String(Math.floor(new Date(form[k].value).getTime() / 1000)));
    if (form.meta.checked) p.set("meta", "1");
    if (params.get("limit")) p.set("limit", params.get("limit"));
    location.hash = `#/audit?${p}`;
  }}, [["device", "device"], ["task", "task id"], ["token", "caller (token name)"], ["tool", "tool"]].map(([k, label]) =>
    h("div", {}, h("label", {for: `f-${k}`}, label), h("input", {id: `f-${k}`, name: k, value: params.get(k) || ""}))),
  h("div", {}, h("label", {for: "f-status"}, "outcome"), h("select", {id: "f-status", name: "status"},
    ["", "success", "failure", "denied", "pending"].map((s) => h("option", {value: s, selected: s === outcome}, s || "any")))),
  ["since", "until"].map((k) => h("div", {}, h("label", {for: `f-${k}`}, k), h("input", {id: `f-${k}`, name: k, type: "datetime-local", value: local(params.get(k))}))),
  h("div", {}, h("label", {class: "inline"}, h("input", {type: "checkbox", name: "meta", checked: meta}), " meta calls (tool listings, transfer chunks)")),
  h("div", {}, h("button", {type: "submit"}, "Filter")));
  const hidden = all.length - rows.length;
  const table = rows.length ? h("div", {class: "scroll"}, h("table", {"aria-label": "audit"},
    h("thead", {}, h("tr", {}, ["When", "Device", "Tool", "Outcome", "Caller", "Arguments"].map((c, i) => h("th", {scope: "col", class: i === 5 ? "hide-sm" : null}, c)))),
    h("tbody", {}, rows.map((r) => h("tr", {"data-audit": r.id},
      h("td", {}, when(r.at)), h("td", {}, h("a", {href: `#/devices/${encodeURIComponent(r.device)}`}, r.device)),
      h("td", {}, h("code", {}, r.tool_name)), h("td", {}, auditStatus(r.status), r.error ? h("div", {class: "error small"}, String(r.error).slice(0, 300)) : null),
      h("td", {}, caller(r.requested_by), r.approved_by ? h("div", {class: "muted small"}, `approved by ${r.approved_by}`) : null),
      h("td", {class: "hide-sm args"}, summarise(r.arguments)))))))
    : h("table", {"aria-label": "audit"}, h("tbody", {}, h("tr", {}, h("td", {}, all.length ? "Only meta calls or other outcomes on this page." : "Nothing recorded for this filter."))));
  const main = draw(h("h1", {}, "Audit log"), form, table);
  if (hidden) main.append(h("p", {class: "muted"}, `${hidden} row(s) on this page hidden by the filter.`));
  if (next !== null && next !== undefined) { const p = new URLSearchParams(params); p.set("before", next); main.append(h("a", {href: `#/audit?${p}`}, "Older entries →")); }
}

// -- tokens --------------------------------------------------------------------------------------
function confirmButton(label, question, act) {  // a second click, on a question that names what goes
  const cell = h("span", {});
  const ask = () => cell.replaceChildren(h("span", {role: "alert"}, question, " "),
    h("button", {type: "button", class: "danger", onclick: act}, `Yes, ${label.toLowerCase()}`),
    h("button", {type: "button", class: "secondary", onclick: () => cell.replaceChildren(first)}, "Keep it"));
  const first = h("button", {type: "button", class: "danger", onclick: ask}, label);
  cell.append(first);
  return cell;
}
async function tokensView() {
  const draw = drawer();
  const tokens = await api("/api/v1/tokens");
  const shown = h("div", {"aria-live": "polite"});
  const form = h("form", {class: "card", id: "new-token", onsubmit: async (e) => {
    e.preventDefault();
    try {
      const scopes = [...form.querySelectorAll("input[name=scope]:checked")].map((x) => x.value);
      const made = await api("/api/v1/tokens", {method: "POST", body: {kind: form.kind.value, name: form.tname.value, scopes: form.kind.value === "api" ? scopes : [], agent: form.kind.value === "api" && form.agent.checked}});
      shown.replaceChildren(h("p", {}, "Copy it now; it is not shown again:"), h("pre", {id: "new-secret"}, made.token));
      tokensView().then(() => $("#main").prepend(shown));
    } catch (x) { toast(`error: ${x.message}`); }
  }}, h("h2", {}, "Create a token"), h("label", {for: "tname"}, "Name"), h("input", {id: "tname", name: "tname", required: true}),
    h("label", {for: "kind"}, "Kind"), h("select", {id: "kind", name: "kind"}, h("option", {value: "api"}, "api"), h("option", {value: "device"}, "device")),
    h("fieldset", {}, h("legend", {}, "Scopes"), ["read", "execute", "approve", "admin"].map((s) => h("label", {class: "inline"}, h("input", {type: "checkbox", name: "scope", value: s}), ` ${s}`))),
    h("label", {class: "inline"}, h("input", {type: "checkbox", name: "agent", id: "agent"}), " an agent's token (it never approves: no approve or admin)"),
    h("button", {type: "submit"}, "Create"));
  const mine = (t) => S.me && t.kind === "api" && t.name === S.me.name;
  draw(h("h1", {}, "Tokens"), shown, form, tokens.length ? h("div", {class: "scroll"}, h("table", {"aria-label": "tokens"},
    h("thead", {}, h("tr", {}, ["Name", "Id", "Kind", "Holder", "Scopes", "Created", "Last used", "Status", ""].map((t, i) => h("th", {scope: "col", class: [1, 3, 5].includes(i) ? "hide-sm" : null}, t)))),
    h("tbody", {}, tokens.map((t) => h("tr", {"data-token": t.id},
      h("td", {}, t.name, mine(t) ? h("span", {class: "muted"}, " (you)") : null), h("td", {class: "hide-sm"}, h("code", {}, String(t.id || "").slice(0, 12))),
      h("td", {}, t.kind), h("td", {class: "hide-sm"}, t.kind === "device" ? "device" : t.agent ? "agent" : "person"),
      h("td", {}, (t.scopes || []).join(", ") || "—"), h("td", {class: "hide-sm"}, when(t.created_at)), h("td", {}, t.last_used_at ? when(t.last_used_at) : "never"),
      h("td", {}, t.revoked_at ? h("span", {}, "revoked ", when(t.revoked_at)) : "active"),
      h("td", {}, t.revoked_at ? "" : confirmButton("Revoke", mine(t) ? `Revoke ${t.name}, the token you are logged in with? This page stops working.` : `Revoke ${t.name}? Whatever holds it stops working.`,
        () => api(`/api/v1/tokens/${encodeURIComponent(t.id || t.name)}`, {method: "DELETE"}).then(() => (mine(t) ? route() : tokensView()), fail))))))))
    : empty("No tokens yet."));
}

// -- the approval inbox --------------------------------------------------------------------------
// Drawn whole once per navigation; then each push of the approvals stream (app.js badge()) and each answer given
// here refreshes it in place (refreshInbox → syncInbox): cards are added, removed or redrawn by the item's id, and
// a card whose item did not change keeps its DOM node, so a person's focus, scroll and selection survive a
// change to another card.
async function inboxView() {
  const draw = drawer();
  const items = await api("/api/v1/approvals");
  const box = h("div", {id: "inbox"});
  draw(h("h1", {}, "Inbox"), h("p", {class: "muted"}, "What waits for your answer: approvals, plans to confirm, questions."), box);
  syncInbox(box, items);
}
// the inbox page's items again, applied in place; a refresh overtaken by a newer one, or by another page, draws nothing
async function refreshInbox() {
  const box = $("#inbox");
  if (!box) return;
  const turn = ++S.inboxTurn;
  const items = await api("/api/v1/approvals");
  if (turn === S.inboxTurn && box.isConnected) syncInbox(box, items);
}
// make `box`'s cards the `items`, in their order: an unchanged item's card stays the same node (not moved when
// its place among the cards that stay is the same), a changed one is redrawn, a gone one removed
function syncInbox(box, items) {
  const want = new Set(items.map((i) => i.id));
  for (const el of [...box.children]) if (!want.has(el.dataset.item)) el.remove();
  const have = new Map([...box.children].map((el) => [el.dataset.item, el]));
  items.forEach((item, index) => {
    const sig = JSON.stringify(item);
    let el = have.get(item.id);
    if (el && el.inboxSig !== sig) { const fresh = inboxCard(item); el.replaceWith(fresh); el = fresh; }
    if (!el) el = inboxCard(item);
    el.inboxSig = sig;
    const here = box.children[index] || null;
    if (here !== el) box.insertBefore(el, here);
  });
  const none = $("#inbox-empty");
  if (items.length) { if (none) none.remove(); }
  else if (!none) box.after(h("p", {id: "inbox-empty", class: "empty muted"}, "Nothing waits for you."));
}
function decideInbox(item, verb, answer) {
  let call;
  if (item.source === "device") {
    const path = `/api/v1/devices/${encodeURIComponent(item.device)}/questions/${encodeURIComponent(item.question_id)}`;
    if (verb === "approve" && answer === undefined && consent(item.schema) === null) {  // a choice is the person's
      toast(`${item.id.slice(0, 24)} asks to choose or write something, not a yes: answer it with tether approvals answer`);
      return Promise.resolve();
    }
    call = api(path, {method: "POST", body: verb === "deny" ? {action: "decline"} : {action: "accept", content: answer === undefined ? consent(item.schema) : {[Object.keys((item.schema || {}).properties || {answer: 1})[0]]: answer}}});
  } else if (item.kind !== "question") {  // an approval or a plan to confirm: yes or no, bound to its digest
    call = api(`/api/v1/tasks/${encodeURIComponent(item.task)}/approval`, {method: "POST", body: {approved: verb === "approve", digest: item.digest || undefined}});
  } else {
    call = api(`/api/v1/tasks/${encodeURIComponent(item.task)}/answer`, {method: "POST", body: {answer, question_id: item.question_id, digest: item.digest || undefined}});
  }
  return call.then(() => { toast(`${verb === "deny" ? "denied" : "answered"}: ${item.id.slice(0, 24)}`); return refreshInbox(); }, fail);
}
function inboxCard(i) {  // every string from the item goes in as text (h)
  const buttons = i.source === "task" && i.kind === "question"
    ? (i.options || []).map((o) => h("button", {type: "button", class: "secondary", onclick: () => decideInbox(i, "answer", o)}, o))
    : [h("button", {type: "button", onclick: () => decideInbox(i, "approve")}, "Approve"), h("button", {type: "button", class: "danger", onclick: () => decideInbox(i, "deny")}, "Deny")];
  return h("div", {class: "card", "data-item": i.id, role: "region", "aria-label": `${i.kind} ${i.id}`},
    h("p", {}, h("strong", {}, i.kind), " · ", i.device ? h("a", {href: `#/devices/${encodeURIComponent(i.device)}`}, i.device) : "—",
      " · asked ", when(i.asked_at), " · by ", i.requested_by || "—",
      i.task ? [" · ", h("a", {href: `#/tasks/${encodeURIComponent(i.task)}`}, `task ${i.task.slice(0, 12)}`)] : null),
    h("p", {class: "question"}, i.question), i.changes ? h("p", {class: "muted"}, `${i.changes} file change(s) held: open the task to see them`) : null,
    buttons);
}
function consent(schema) {  // yes to a consent form: every boolean true, a yes-like choice (as `tether approvals approve`);
  // null for a form asking anything else (a choice with no yes, a text): a yes never becomes a choice nobody made
  const yes = ["yes", "approve", "approved", "allow", "accept", "confirm", "confirmed", "ok", "proceed", "y"];
  const out = {};
  for (const [k, f] of Object.entries((schema || {}).properties || {})) {
    if (!f || typeof f !== "object") continue;
    if (f.type === "boolean") { out[k] = true; continue; }
    const picked = Array.isArray(f.enum) ? f.enum.find((o) => yes.includes(String(o).trim().toLowerCase())) : undefined;
    if (picked === undefined) return null;
    out[k] = picked;
  }
  return Object.keys(out).length ? out : undefined;
}

// -- webhooks ------------------------------------------------------------------------------------
const EVENTS = ["approval.needed", "task.finished", "task.failed", "device.offline"];
async function webhooksView() {
  const draw = drawer();
  const hooks = await api("/api/v1/webhooks");
  const shown = h("div", {"aria-live": "polite"});
  const err = h("p", {class: "error", role: "alert"});
  const form = h("form", {class: "card", id: "new-webhook", onsubmit: async (e) => {
    e.preventDefault(); err.textContent = "";
    try {
      const events = [...form.querySelectorAll("input[name=event]:checked")].map((x) => x.value);
      const made = await api("/api/v1/webhooks", {method: "POST", body: {url: form.url.value.trim(), events, format: form.format.value, server_wide: form.wide.checked}});
      await webhooksView();
      $("#main").prepend(h("div", {class: "card"}, h("p", {}, `Webhook ${made.id} added. Its signing secret, shown this once:`), h("pre", {id: "webhook-secret"}, made.secret)));
    } catch (x) { err.textContent = x.message; }
  }}, h("h2", {}, "Add a webhook"), h("label", {for: "wh-url"}, "URL (http:// or https://)"), h("input", {id: "wh-url", name: "url", required: true, placeholder: "https://hooks.example.com/tether"}),
    h("fieldset", {}, h("legend", {}, "Events"), EVENTS.map((ev) => h("label", {class: "inline"}, h("input", {type: "checkbox", name: "event", value: ev, checked: true}), ` ${ev}`))),
    h("label", {for: "wh-format"}, "Format"), h("select", {id: "wh-format", name: "format"}, h("option", {value: "generic"}, "generic JSON"), h("option", {value: "slack"}, "Slack-compatible")),
    can("admin") ? h("label", {class: "inline"}, h("input", {type: "checkbox", name: "wide"}), " server-wide (every event, not only your token's)") : h("input", {type: "hidden", name: "wide"}),
    h("button", {type: "submit"}, "Add"), err);
  const deliveries = async (hook, into) => {
    const rows = await api(`/api/v1/webhooks/${encodeURIComponent(hook.id)}/deliveries?limit=20`).catch((x) => { fail(x); return []; });
    into.replaceChildren(rows.length ? h("table", {"aria-label": `deliveries of ${hook.id}`}, h("thead", {}, h("tr", {}, ["Event", "Status", "Attempts", "HTTP", "Error", "When"].map((c) => h("th", {scope: "col"}, c)))),
      h("tbody", {}, rows.map((d) => h("tr", {}, h("td", {}, d.event), h("td", {}, status(d.status === "delivered" ? "done" : d.status === "failed" ? "failed" : "running"), " ", d.status),
        h("td", {}, String(d.attempts ?? "—")), h("td", {}, String(d.last_status ?? "—")), h("td", {}, d.last_error ? String(d.last_error).slice(0, 200) : "—"), h("td", {}, when(d.created_at || d.updated_at))))))
      : empty("No deliveries yet."));
  };
  draw(h("h1", {}, "Webhooks"), shown, form, hooks.length ? h("div", {id: "webhooks"}, hooks.map((hk) => {
    const log = h("div", {class: "scroll"});
    return h("div", {class: "card", "data-webhook": hk.id}, h("p", {}, h("strong", {}, hk.id), " ", h("code", {class: "url"}, hk.url)),
      h("p", {class: "muted"}, `${hk.events.join(", ")} · ${hk.format} · ${hk.server_wide ? "server-wide" : `token ${hk.owner || "—"}`} · ${hk.source} · added `, when(hk.created_at)),
      h("button", {type: "button", class: "secondary", onclick: () => deliveries(hk, log)}, "Deliveries"),
      h("button", {type: "button", class: "secondary", onclick: () => api(`/api/v1/webhooks/${encodeURIComponent(hk.id)}/test`, {method: "POST"}).then(() => { toast(`ping queued for ${hk.id}`); deliveries(hk, log); }, fail)}, "Send a test"),
      hk.source === "config" ? h("span", {class: "muted"}, " (from the server's config file)")
        : confirmButton("Remove", `Remove webhook ${hk.id}?`, () => api(`/api/v1/webhooks/${encodeURIComponent(hk.id)}`, {method: "DELETE"}).then(webhooksView, fail)),
      log);
  })) : empty("No webhooks yet: add one to hear of approvals needed, tasks finished or failed, devices offline."));
}

// -- a device's actions (admin): rename, tags, remove; its policy (read) --------------------------
function deviceActions(d) {
  const box = h("section", {class: "card", id: "device-actions", "aria-label": "manage the device"}, h("h2", {}, "Manage"));
  const err = h("p", {class: "error", role: "alert"});
  const patch = (body) => api(`/api/v1/devices/${encodeURIComponent(d.name)}`, {method: "PATCH", body})
    .then((r) => { toast(`saved ${r.name}`); location.hash = `#/devices/${encodeURIComponent(r.name)}`; route(); }, (x) => { err.textContent = x.message; });
  const name = h("input", {id: "dev-name", value: d.name, required: true});
  const tags = h("input", {id: "dev-tags", value: (d.tags || []).join(", ")});
  box.append(h("div", {class: "row"},
    h("div", {}, h("label", {for: "dev-name"}, "Rename to"), name, h("button", {type: "button", class: "secondary", onclick: () => patch({name: name.value.trim()})}, "Rename")),
    h("div", {}, h("label", {for: "dev-tags"}, "Tags (comma-separated)"), tags,
      h("button", {type: "button", class: "secondary", onclick: () => patch({tags: tags.value.split(",").map((t) => t.trim()).filter(Boolean)})}, "Save tags"))),
  h("p", {}, confirmButton("Remove device", `Remove ${d.name}? Its tokens and key are revoked; it must pair again to come back.`,
    () => api(`/api/v1/devices/${encodeURIComponent(d.name)}`, {method: "DELETE"}).then(() => { toast(`removed ${d.name}`); location.hash = "#/devices"; }, (x) => { err.textContent = x.message; }))), err);
  return box;
}
// the device's effective policy, asked live when opened; an admin allows, denies or puts a program under
// approval (POST /devices/{name}/policy/{verb}), and the table shows the device's answer
async function policySection(name) {
  const body = h("div", {});
  const box = h("details", {class: "card", id: "policy"}, h("summary", {}, "Policy"), body);
  const show = (p) => body.replaceChildren(h("p", {class: "muted"}, `${p.remote_allowed ? "takes" : "does not take"} changes from this server · ${p.version} remote change(s) applied`),
    can("admin") && p.remote_allowed ? programForm(name, show) : null,
    h("div", {class: "scroll"}, h("table", {"aria-label": "policy"}, h("thead", {}, h("tr", {}, ["Setting", "Value", "From"].map((c) => h("th", {scope: "col"}, c)))),
      h("tbody", {}, Object.entries(p.policy).map(([k, v]) => h("tr", {"data-setting": k}, h("td", {}, h("code", {}, k)),
        h("td", {class: "args"}, setting(k, v)), h("td", {}, from(p.sources[k]))))))));
  box.addEventListener("toggle", async () => {
    if (!box.open || box.dataset.loaded) return;
    box.dataset.loaded = "1";
    try { show(await api(`/api/v1/devices/${encodeURIComponent(name)}/policy`)); } catch (x) { body.replaceChildren(h("p", {class: "error"}, x.message)); }
  });
  return box;
}
// a policy value, short: the allowlist as program names (those a person approves marked), others as JSON
function setting(key, value) {
  if (key === "commands" && value && typeof value === "object") {
    return Object.entries(value).map(([prog, rule]) => `${prog}${rule && rule.approve ? " (a person approves)" : rule && rule.read_only ? "" : " (writes)"}`).join(", ");
  }
  return typeof value === "object" && value !== null ? JSON.stringify(value) : String(value);
}
function from(source) {  // where a value comes from: default, file or remote (per program for the allowlist)
  if (source && typeof source === "object") return [...new Set(Object.values(source).map(String))].join(", ") || "default";
  return String(source ?? "default");
}
function programForm(name, show) {
  const err = h("p", {class: "error", role: "alert"});
  const program = h("input", {id: "pol-program", placeholder: "git", pattern: "[A-Za-z0-9._+-]+", size: 12});
  const act = (verb) => api(`/api/v1/devices/${encodeURIComponent(name)}/policy/${verb}`, {method: "POST", body: {program: program.value.trim()}})
    .then((p) => { toast(`${program.value.trim()}: ${verb === "approve" ? "needs approval" : verb === "allow" ? "allowed" : "removed"} on ${name}`); show(p); }, (x) => { err.textContent = x.message; });
  return h("div", {class: "row", id: "program-rule"}, h("div", {}, h("label", {for: "pol-program"}, "Program"), program,
    h("button", {type: "button", class: "secondary", onclick: () => act("allow")}, "Allow"),
    h("button", {type: "button", class: "secondary", onclick: () => act("approve")}, "Ask a person each run"),
    h("button", {type: "button", class: "danger", onclick: () => act("deny")}, "Remove from allowlist")), err);
}
