// The tether dashboard: one page, no build step, no framework. It calls the REST API with the session
// cookie (and the CSRF token on every state-changing request); live views read server-sent events.
"use strict";
const S = {me: null, streams: [], fleet: {}, inbox: null, turn: 0, inboxTurn: 0};
const $ = (sel) => document.querySelector(sel);

function h(tag, attrs, ...kids) {  // DOM built from data, never from HTML strings
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v); else el.setAttribute(k, v === true ? "" : v);
  }
  for (const kid of kids.flat()) if (kid !== null && kid !== undefined) el.append(kid.nodeType ? kid : String(kid));
  return el;
}
const status = (s) => h("span", {class: `status s-${s}`}, String(s).replaceAll("_", " "));
const can = (scope) => !!S.me && (S.me.scopes.includes(scope) || S.me.scopes.includes("admin"));
// a message at the corner: it closes by itself after a while, or with its button
function toast(text) {
  const box = $("#toast"); clearTimeout(S.toastTimer);
  box.replaceChildren(h("span", {}, text), " ", h("button", {type: "button", class: "link close", "aria-label": "dismiss", onclick: () => box.replaceChildren()}, "×"));
  S.toastTimer = setTimeout(() => box.replaceChildren(), 10000);
}

async function api(path, opts = {}) {
  const headers = {...(opts.headers || {})};
  const method = opts.method || "GET";
  if (method !== "GET") headers["X-CSRF-Token"] = S.me ? S.me.csrf : "";
  if (opts.body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, {method, headers, credentials: "same-origin",
    body: opts.body === undefined ? undefined : JSON.stringify(opts.body)});
  if (opts.raw) return r;
  const data = await r.json().catch(() => ({error: `HTTP ${r.status}`}));
  if (!r.ok) { if (r.status === 401 && path !== "/web/login") { S.me = null; route(); } throw new Error(data.error || `HTTP ${r.status}`); }
  return data;
}

function stopStreams() { for (const s of S.streams) s.close(); S.streams = []; }
function view(...kids) { stopStreams(); const m = $("#main"); m.replaceChildren(...kids); m.inert = false; m.removeAttribute("aria-busy"); return m; }
// view() for a page that loads first: called at the page's start (before its first await), it draws only if no
// other page was asked for meanwhile (a later link or route() wins, whatever order the answers come back in);
// a superseded page gets a detached element, so it draws nothing and its streams are not started
function drawer() { const turn = S.turn; return (...kids) => (turn === S.turn ? view(...kids) : h("div", {})); }
function fail(err) { toast(`error: ${err.message}`); }

// -- login --------------------------------------------------------------------------------------
function loginView() {
  $("#nav").hidden = true; $("#who").textContent = "";  // nothing of the last session stays on the page
  const err = h("p", {class: "error", role: "alert"});
  const form = h("form", {class: "card", onsubmit: async (e) => {
    e.preventDefault();
    try { S.me = await api("/web/login", {method: "POST", body: {token: form.token.value}}); form.reset(); location.hash = "#/devices"; route(); }
    catch (x) { err.textContent = x.message; }
  }}, h("h1", {}, "Log in"), h("label", {for: "token"}, "API token"),
    h("input", {id: "token", name: "token", type: "password", autocomplete: "off", required: true}),
    h("button", {type: "submit"}, "Log in"), err,
    h("p", {class: "muted"}, "Create one with: tether token create --api NAME --scope read"));
  view(form); form.token.focus();
}

// -- devices ------------------------------------------------------------------------------------
function deviceRow(d) {
  return h("tr", {"data-device": d.name},
    h("td", {}, h("a", {href: `#/devices/${encodeURIComponent(d.name)}`}, d.name)), h("td", {"data-col": "status"}, status(d.status)),
    h("td", {}, d.platform || "—"), h("td", {class: "hide-sm"}, (d.tags || []).join(", ") || "—"),
    h("td", {class: "hide-sm"}, d.sandbox || "—"), h("td", {}, `${d.load} / ${d.running}`), h("td", {class: "hide-sm"}, when(d.last_seen)));
}
function devicesView() {
  const body = h("tbody", {});
  const table = h("div", {class: "scroll"}, h("table", {"aria-label": "devices"}, h("thead", {}, h("tr", {},
    ["Device", "Status", "Platform", "Tags", "Sandbox", "Load / running", "Last seen"].map((t, i) => h("th", {scope: "col", class: i === 3 || i === 4 || i === 6 ? "hide-sm" : null}, t)))), body));
  const pending = h("section", {id: "pairing", "aria-live": "polite"});
  view(h("h1", {}, "Devices"), pending, table);
  if (can("admin")) pairingPanel(pending);
  const es = new EventSource("/web/fleet");
  S.streams.push(es);
  const put = (d) => { const old = body.querySelector(`tr[data-device="${CSS.escape(d.name)}"]`); const row = deviceRow(d); old ? old.replaceWith(row) : body.append(row); };
  const none = h("tr", {class: "empty"}, h("td", {colspan: "7", class: "muted"}, "No devices yet. Start one with: tether device --pair --server URL"));
  es.addEventListener("devices", (e) => { body.replaceChildren(); const rows = JSON.parse(e.data); rows.forEach(put); if (!rows.length) body.append(none); });
  es.addEventListener("device", () => none.remove());
  es.addEventListener("pairing", () => { if (can("admin")) pairingPanel(pending); });  // a request arrived or was decided
  es.addEventListener("device", (e) => put(JSON.parse(e.data)));
}

// devices asking to pair (tether device --pair): an admin compares the code and fingerprint the device
// shows, then lets it in under a name and tags, or refuses it
async function pairingPanel(into) {
  let waiting;
  try { waiting = await api("/api/v1/pairing"); } catch (x) { return; }  // pairing switched off
  if (!waiting.length) { into.replaceChildren(); return; }
  const decide = (code, verb, body) => api(`/api/v1/pairing/${encodeURIComponent(code)}/${verb}`, {method: "POST", body})
    .then(() => { toast(`${verb === "approve" ? "approved" : "refused"} ${code}`); pairingPanel(into); }, fail);
  into.replaceChildren(h("h2", {}, `Waiting to pair (${waiting.length})`), h("div", {class: "scroll"}, h("table", {"aria-label": "pairing requests"},
    h("thead", {}, h("tr", {}, ["Code", "Fingerprint", "Name", "Tags", "From", ""].map((t) => h("th", {scope: "col"}, t)))),
    h("tbody", {}, waiting.map((r) => {
      const name = h("input", {"aria-label": `name for ${r.code}`, value: r.requested_name || "", required: true, size: 12});
      const tags = h("input", {"aria-label": `tags for ${r.code}`, placeholder: "lab, gpu", size: 10});
      // a name another device holds (r.collision says why) is taken only when the admin ticks "replace",
      // which revokes that device's tokens and key; otherwise the server refuses the approval
      const replace = h("input", {type: "checkbox", "aria-label": `replace the existing device for ${r.code}`});
      const taken = r.collision ? h("div", {class: "collision", "data-collision": r.code}, `taken: ${r.collision} `,
        h("label", {}, replace, " replace it")) : null;
      return h("tr", {"data-pairing": r.code}, h("td", {}, h("code", {}, r.code)), h("td", {}, h("code", {}, r.fingerprint.slice(0, 16))),
        h("td", {}, name, taken), h("td", {}, tags), h("td", {}, r.address),
        h("td", {}, h("button", {type: "button", onclick: () => decide(r.code, "approve",
          {name: name.value || null, tags: tags.value.split(",").map((t) => t.trim()).filter(Boolean),
           replace: replace.checked})}, "Approve"),
          " ", h("button", {type: "button", class: "danger", onclick: () => decide(r.code, "refuse")}, "Refuse")));
    })))));
}

function fieldFor(name, schema, required) {
  const id = `arg-${name}`;
  const pickType = (t) => Array.isArray(t) ? t.find((x) => x !== "null") : t;  // optional fields: [T, "null"] or anyOf
  const type = pickType(schema.type) || pickType(((schema.anyOf || []).find((x) => x.type && x.type !== "null") || {}).type);
  const hint = schema.description ? h("span", {class: "muted"}, ` — ${schema.description}`) : null;
  let input;
  if (type === "boolean") input = h("input", {id, name, type: "checkbox", "data-type": "boolean"});
  else if (Array.isArray(schema.enum)) input = h("select", {id, name, "data-type": "string"}, schema.enum.map((v) => h("option", {}, v)));
  else if (type === "integer" || type === "number") input = h("input", {id, name, type: "number", step: type === "integer" ? "1" : "any", "data-type": type, required});
  else if (type === "string") input = h("input", {id, name, "data-type": "string", required});
  else input = h("textarea", {id, name, "data-type": "json", required, placeholder: "JSON"});
  return h("div", {}, h("label", {for: id}, name, required ? " *" : "", hint), input);
}
function readArgs(form) {
  const args = {};
  for (const el of form.querySelectorAll("[data-type]")) {
    const t = el.dataset.type;
    if (t === "boolean") { if (el.checked) args[el.name] = true; continue; }
    if (el.value === "") continue;
    args[el.name] = t === "integer" ? parseInt(el.value, 10) : t === "number" ? Number(el.value) : t === "json" ? JSON.parse(el.value) : el.value;
  }
  return args;
}
async function readSSE(response, onFrame) {  // a streamed POST cannot use EventSource
  const reader = response.body.getReader(); const dec = new TextDecoder(); let buf = "";
  for (;;) {
    const {value, done} = await reader.read(); if (done) break;
    buf += dec.decode(value, {stream: true});
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const frame = buf.slice(0, cut); buf = buf.slice(cut + 2);
      let ev = "message", data = "";
      for (const line of frame.split("\n")) { if (line.startsWith("event: ")) ev = line.slice(7); else if (line.startsWith("data: ")) data += line.slice(6); }
      if (data) onFrame(ev, JSON.parse(data));
    }
  }
}
async function deviceView(name) {
  const draw = drawer();
  const d = await api(`/api/v1/devices/${encodeURIComponent(name)}`);
  const tools = await api(`/api/v1/devices/${encodeURIComponent(name)}/tools`).catch(() => (d.profile ? d.profile.tools : []));
  const badge = h("span", {id: "device-status", "data-status": d.status, "aria-live": "polite"}, status(d.status));
  const main = draw(h("h1", {}, `Device ${d.name} `, badge),
    h("div", {class: "card"}, h("p", {}, `Platform: ${d.platform || "—"} · tags: ${(d.tags || []).join(", ") || "—"} · sandbox: ${d.sandbox || "—"} · load ${d.load}`),
      h("details", {}, h("summary", {}, "Full profile"), h("pre", {}, JSON.stringify(d.profile, null, 2)))), await policySection(d.name));
  if (can("admin")) main.append(deviceActions(d));  // manage.js: rename, tags, remove
  if (can("execute") && tools.some((t) => t.name === "screenshot"))  // the live view (screen.js)
    main.append(h("p", {}, h("a", {href: `#/devices/${encodeURIComponent(d.name)}/screen`, id: "screen-link"}, "Screen: watch it live, take over")));
  if (can("execute")) {
    const fields = h("div", {});
    const out = h("pre", {id: "tool-output", "aria-live": "polite"});
    const pick = h("select", {id: "tool", name: "tool", onchange: () => showFields()}, tools.map((t) => h("option", {value: t.name}, t.name)));
    const showFields = () => {
      const t = tools.find((x) => x.name === pick.value); const schema = (t && t.input_schema) || {};
      const req = schema.required || [];
      fields.replaceChildren(...Object.entries(schema.properties || {}).map(([k, s]) => fieldFor(k, s, req.includes(k))));
    };
    const form = h("form", {class: "card", id: "run-tool", onsubmit: async (e) => {
      e.preventDefault(); out.textContent = "";
      let args; try { args = readArgs(form); } catch (x) { out.textContent = `error: ${x.message}`; return; }
      const r = await api(`/api/v1/devices/${encodeURIComponent(name)}/commands`, {method: "POST", raw: true, headers: {Accept: "text/event-stream"},
        body: {commands: [{tool_name: pick.value, parameters: args}], timeout: 120}});
      if (!r.ok) { const e2 = await r.json().catch(() => ({})); out.textContent = `error: ${e2.error || r.status}`; return; }
      await readSSE(r, (ev, data) => {
        if (ev === "event" && data.data && typeof data.data.data === "string") out.append(data.data.data);
        else if (ev === "results") for (const res of data.results) out.append(`\n[${res.status}] ${res.error || (typeof res.result === "string" ? res.result : JSON.stringify(res.result, null, 2))}\n`);
      });
    }}, h("h2", {}, "Run a tool"), h("label", {for: "tool"}, "Tool"), pick, fields, h("button", {type: "submit"}, "Run"), out);
    main.append(form); showFields();
  }
  main.append(h("h2", {}, `Tools (${tools.length})`), ...tools.map((t) => h("details", {class: "card"},
    h("summary", {}, h("strong", {}, t.name), " ", h("span", {class: "muted"}, t.description || "")), h("pre", {}, JSON.stringify(t.input_schema, null, 2)))));
  if (main.isConnected) followStatus(d.name, badge);
}
// the device's status as the fleet stream pushes it, changed in place: the rest of the page (a form being
// filled, an open "Yes, remove device" question) is never drawn again under the person
function followStatus(name, badge) {
  const es = new EventSource(`/web/fleet?device=${encodeURIComponent(name)}`);  // its row alone
  S.streams.push(es);  // closed when the page changes (view)
  const show = (d) => { if (d.name === name && badge.dataset.status !== d.status) { badge.dataset.status = d.status; badge.replaceChildren(status(d.status)); } };
  es.addEventListener("devices", (e) => JSON.parse(e.data).forEach(show));
  es.addEventListener("device", (e) => show(JSON.parse(e.data)));
}

// -- tasks --------------------------------------------------------------------------------------
const STATES = ["", "created", "planning", "running", "recovering", "waiting_for_user", "done", "failed", "cancelled"];
async function tasksView(params) {
  const draw = drawer();
  const state = params.get("state") || "";
  const tasks = await api(`/api/v1/tasks?limit=100${state ? `&state=${encodeURIComponent(state)}` : ""}`);
  const filter = h("select", {id: "state-filter", onchange: () => { location.hash = `#/tasks${filter.value ? `?state=${filter.value}` : ""}`; }},
    STATES.map((s) => h("option", {value: s, selected: s === state}, s ? s.replaceAll("_", " ") : "any state")));
  const main = draw(h("h1", {}, "Tasks"), h("label", {for: "state-filter"}, "State"), filter);
  if (can("execute")) main.append(await newTaskForm());
  main.append(h("div", {class: "scroll"}, h("table", {"aria-label": "tasks"}, h("thead", {}, h("tr", {}, ["Task", "State", "Request", "Device", "Asked by", "Created"].map((t, i) => h("th", {scope: "col", class: i === 4 ? "hide-sm" : null}, t)))),
    h("tbody", {}, tasks.length ? tasks.map((t) => h("tr", {}, h("td", {}, h("a", {href: `#/tasks/${t.id}`}, t.id.slice(0, 12))), h("td", {}, status(t.state)),
      h("td", {class: "wrap"}, t.request || "(plan)"), h("td", {}, t.device || "—"), h("td", {class: "hide-sm"}, t.requested_by || "—"), h("td", {}, when(t.created_at))))
      : h("tr", {}, h("td", {colspan: "6", class: "muted"}, state ? `No ${state.replaceAll("_", " ")} tasks.` : "No tasks yet."))))));
}
async function newTaskForm() {
  const devices = await api("/api/v1/devices");
  const err = h("p", {class: "error", role: "alert"});
  const form = h("form", {class: "card", id: "new-task", onsubmit: async (e) => {
    e.preventDefault(); err.textContent = "";
    try {
      const body = {request: form.request.value.trim()};
      if (form.plan.value.trim()) body.plan = (await api("/web/plan", {method: "POST", body: {text: form.plan.value}})).plan;
      if (form.device.value) body.device = form.device.value;
      else if (form.tags.value.trim()) body.requires = {tags: form.tags.value.split(",").map((s) => s.trim()).filter(Boolean)};
      const t = await api("/api/v1/tasks", {method: "POST", body});
      location.hash = `#/tasks/${t.id}`;
    } catch (x) { err.textContent = x.message; }
  }}, h("h2", {}, "Start a task"), h("label", {for: "request"}, "Request, in plain words"), h("input", {id: "request", name: "request"}),
    h("label", {for: "plan"}, "…or a plan (YAML or JSON list of {skill, args})"), h("textarea", {id: "plan", name: "plan"}),
    h("div", {class: "row"}, h("div", {}, h("label", {for: "device"}, "Device"), h("select", {id: "device", name: "device"},
      h("option", {value: ""}, "any that meets the requirements"), devices.map((d) => h("option", {value: d.name}, `${d.name} (${d.status})`)))),
      h("div", {}, h("label", {for: "tags"}, "Required tags (comma-separated)"), h("input", {id: "tags", name: "tags"}))),
    h("button", {type: "submit"}, "Start"), err);
  return form;
}
function eventLine(e) {
  const d = e.data || {};
  const text = e.kind === "output" ? d.data : d.question || d.state || d.error || d.answer || d.description || (Object.keys(d).length ? JSON.stringify(d) : "");
  return h("li", {"data-seq": e.seq}, h("span", {class: "muted"}, `#${e.seq} `), h("strong", {}, e.kind), " ", String(text || "").slice(0, 2000));
}
// A graph plan drawn by stage, left to right: a column per stage, a box per step with its state, live;
// each box names the steps it needs (drawn before it). Text only, never HTML from the task.
function graphDrawing(t) {
  const nodes = t.graph.nodes; const name = (n) => nodes[n].id || String(n + 1);
  const stages = [];
  nodes.forEach((g, i) => { (stages[g.stage] = stages[g.stage] || []).push([g, i]); });
  return h("div", {class: "gdraw", id: "graph", role: "group", "aria-label": `graph of ${nodes.length} steps in ${stages.length} stages`},
    stages.map((column, stage) => h("div", {class: "gcol", "data-stage": stage}, h("p", {class: "muted"}, `stage ${stage}`),
      (column || []).map(([g, i]) => h("div", {class: "gnode", "data-node": name(i), "data-state": g.state},
        h("strong", {}, name(i)), " ", status(g.state), h("br", {}), h("span", {class: "muted"}, t.plan.steps[i].skill, g.device ? ` on ${g.device}` : ""),
        g.needs.length ? h("div", {class: "gneeds"}, `\u2190 ${g.needs.map(name).join(", ")}`) : null)))));
}
async function taskView(id) {
  const header = h("div", {}); const steps = h("div", {}); const ask = h("div", {}); const log = h("ul", {class: "events", "aria-label": "events"});
  const drawn = h("div", {}); const changed = h("div", {});
  view(header, ask, drawn, h("h2", {}, "Steps"), steps, changed, h("h2", {}, "Events"), log);
  let last = -1; let refreshing = null;
  const refresh = async () => {
    const t = await api(`/api/v1/tasks/${encodeURIComponent(id)}?events=false`);
    const buttons = [];
    if (!["done", "failed", "cancelled"].includes(t.state) && can("execute")) buttons.push(h("button", {class: "danger", id: "cancel", type: "button", onclick: () => api(`/api/v1/tasks/${id}/cancel`, {method: "POST"}).then(refresh, fail)}, "Cancel task"));
    if (can("approve")) buttons.push(h("button", {class: "secondary", id: "undo", type: "button", onclick: () => api(`/api/v1/tasks/${id}/undo`, {method: "POST"}).then(() => toast("undone"), fail)}, "Undo"));
    header.replaceChildren(h("h1", {}, `Task ${t.id.slice(0, 12)} `, status(t.state)), h("div", {class: "card"},
      h("p", {}, h("strong", {}, "Request: "), t.request || "(a plan)"), h("p", {}, `Device: ${t.device || "—"} · by ${t.requested_by || "—"}`),
      t.answer ? h("p", {id: "answer"}, h("strong", {}, "Answer: "), t.answer) : null, t.error ? h("p", {class: "error"}, t.error) : null, buttons));
    drawn.replaceChildren(...(t.graph ? [h("h2", {}, "Graph"), graphDrawing(t)] : []));
    changed.replaceChildren(taskChanges(t));  // changes.js: the files each step changed, with diffs
    steps.replaceChildren(...(t.plan ? t.plan.steps : []).map((s, i) => {
      const runs = (t.steps || []).filter((r) => r.index === i);
      const g = t.graph ? t.graph.nodes[i] : null;  // a graph plan: the step's state, stage and needs, live
      const name = (n) => t.graph.nodes[n].id || String(n + 1);
      return h("div", {class: "card", "data-step": i, "data-state": g ? g.state : null}, h("p", {}, h("strong", {}, `${i + 1}. ${s.skill}`), " ", s.description || ""),
        g ? h("p", {class: "graph"}, status(g.state), ` stage ${g.stage}`, g.id ? ` · id ${g.id}` : "", g.device ? ` · on ${g.device}` : "",
          g.needs.length ? ` · needs ${g.needs.map(name).join(", ")}` : "",
          typeof g.when === "string" ? (g.when === "success" ? "" : ` · when ${g.when}`) : ` · if ${g.when.ref}`) : null,
        h("pre", {}, JSON.stringify(s.args)), runs.map((r) => h("div", {"data-run": r.attempt}, heldForApproval(r) ? h("span", {class: "status s-waiting_for_user"}, "held for approval")
          : status(r.result.status === "success" ? "done" : r.result.status === "failure" ? "failed" : r.result.status),
          r.result.error && !heldForApproval(r) ? h("span", {class: "error"}, ` ${r.result.error}`) : null,
          r.decision ? h("p", {}, `Recovery: ${r.decision.decision || JSON.stringify(r.decision)}`) : null)));
    }));
    const q = (t.questions || []).filter((x) => !x.answer).pop();
    ask.replaceChildren();
    if (q && !q.answer && t.state === "waiting_for_user") {
      // approving (an action, a plan to run) is a person's: an agent's token may not (docs/security/approvals.md)
      const approval = q.kind === "approval" || q.kind === "confirmation";
      const mayAnswer = approval ? can("approve") && !(S.me && S.me.agent) : can("execute");
      ask.append(h("div", {class: "card", id: "question", role: "region", "aria-label": "question"}, h("h2", {}, approval ? "Approval needed" : "Question"),
        h("p", {}, `Asked by ${t.requested_by || "—"}`),
        h("p", {}, q.question), (q.changes || []).length ? h("div", {class: "held"}, h("p", {}, `What would change (${q.changes.length}):`), changeEntries(q.changes)) : null,
        q.digest ? h("p", {class: "muted"}, `digest ${q.digest}`) : null,
        // the answer carries the digest of what is shown here: refused if the task now waits on something else
        mayAnswer ? q.options.map((o) => h("button", {type: "button", class: "secondary", onclick: () => api(`/api/v1/tasks/${id}/answer`, {method: "POST", body: {answer: o, question_id: q.id, digest: q.digest || undefined}}).then(refresh, fail)}, o)) : h("p", {class: "muted"}, "Your token may not answer this: a person approves."),
        // a program outside the device's allowlist (ask on miss): an admin may allow it for good, then it runs
        q.kind === "approval" && /ask\.on-miss/.test(q.question) && can("admin") && can("approve")
          ? [["program", "Always allow the program"], ["subcommand", "Always allow this subcommand"]].map(([what, label]) =>
            h("button", {type: "button", class: "secondary", onclick: () => api(`/api/v1/tasks/${id}/approval`, {method: "POST", body: {approved: true, always: what, digest: q.digest || undefined}}).then(refresh, fail)}, label))
          : null));
    }
  };
  let again = false;  // an event during a refresh: refresh once more after it, or the view keeps the older state
  const later = () => {
    if (refreshing) { again = true; return; }
    refreshing = refresh().then(badge).catch(fail).finally(() => { refreshing = null; if (again) { again = false; later(); } });
  };
  await refresh();
  const open = () => {  // resumes after the last event seen: nothing lost, nothing repeated
    const es = new EventSource(`/api/v1/tasks/${encodeURIComponent(id)}/events?after=${last}`);
    es.onopen = () => { log.dataset.connects = String(Number(log.dataset.connects || 0) + 1); };
    S.streams.push(es);
    es.addEventListener("task_event", (m) => { const e = JSON.parse(m.data); if (e.seq <= last) return; last = e.seq; log.append(eventLine(e)); later(); });
    es.addEventListener("end", () => { es.close(); later(); badge(); });
    es.onerror = () => { es.close(); S.streams = S.streams.filter((x) => x !== es); if (location.hash.startsWith(`#/tasks/${id}`)) setTimeout(open, 1000); };
  };
  open();
}

// -- shell --------------------------------------------------------------------------------------
// the badge counts what waits for this token's answer (GET /api/v1/approvals): pushed by the server as it
// changes (server-sent events), never polled; a lost stream is opened again
function showBadge(count) {
  const b = $("#badge"); b.hidden = !count; b.textContent = String(count); b.title = `${count} waiting for your answer`;
}
function badge() {
  if (!S.me) { if (S.inbox) { S.inbox.close(); S.inbox = null; } showBadge(0); return; }
  if (S.inbox) return;
  const es = S.inbox = new EventSource("/api/v1/approvals/events");
  es.addEventListener("approvals", (m) => {
    showBadge(JSON.parse(m.data).count);
    if (location.hash.startsWith("#/inbox")) refreshInbox().catch(fail);  // the inbox page follows it, in place
  });
  es.onerror = () => { es.close(); if (S.inbox === es) { S.inbox = null; setTimeout(badge, 3000); } };
}
// every navigation (a link, a new address, route() after a change) takes a turn; while its page loads, the page
// shown is inert and aria-busy: a click meant for the next page never lands on the last one's button
async function route() {
  const turn = ++S.turn; const main = $("#main");
  main.inert = true; main.setAttribute("aria-busy", "true");
  try { await showPage(turn); } finally { if (turn === S.turn) { main.inert = false; main.removeAttribute("aria-busy"); } }
}
async function showPage(turn) {
  if (!S.me) { try { S.me = await api("/web/session"); if (!S.me.name) S.me = null; } catch (x) { S.me = null; } }
  if (turn !== S.turn) return;  // another navigation came meanwhile: it draws
  if (!S.me) { stopStreams(); badge(); loginView(); return; }
  $("#nav").hidden = false; $("#who").textContent = `${S.me.name} (${S.me.scopes.join(", ")})`;
  for (const a of document.querySelectorAll("[data-scope]")) a.hidden = !can(a.dataset.scope);
  const [path, query] = (location.hash.slice(1) || "/devices").split("?");
  const params = new URLSearchParams(query || ""); const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  badge();
  try {
    if (parts[0] === "devices" && parts[2] === "screen") screenView(parts[1]);  // screen.js: the live view
    else if (parts[0] === "devices" && parts[1]) await deviceView(parts[1]);
    else if (parts[0] === "tasks" && parts[1]) await taskView(parts[1]);
    else if (parts[0] === "tasks") await tasksView(params);
    else if (parts[0] === "audit") await auditView(params);
    else if (parts[0] === "tokens") await tokensView();
    else if (parts[0] === "inbox") await inboxView();
    else if (parts[0] === "webhooks") await webhooksView();
    else devicesView();
  } catch (x) { if (turn === S.turn) view(h("p", {class: "error", role: "alert"}, x.message)); }
}
window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", () => {
  $("#logout").addEventListener("click", async () => { try { await api("/web/logout", {method: "POST"}); } catch (x) { /* gone already */ } S.me = null; route(); });
  route();
});
