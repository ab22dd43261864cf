// The live view of a device's screen (server/web/screen.py): frames pushed as server-sent events, the
// desktop actions anyone sends drawn on them, and "Take over" / "Hand back". Uses app.js's h, api, view.
"use strict";
const KEYS = {Enter: "Enter", Tab: "Tab", Escape: "Escape", Backspace: "BackSpace", Delete: "Delete", ArrowUp: "Up",
  ArrowDown: "Down", ArrowLeft: "Left", ArrowRight: "Right", Home: "Home", End: "End", PageUp: "Page_Up", PageDown: "Page_Down"};

function screenView(name) {
  const base = `/web/devices/${encodeURIComponent(name)}/screen`;
  const img = h("img", {id: "screen-img", alt: `screen of ${name}`});
  const marks = h("div", {class: "marks", "aria-hidden": "true"});
  const box = h("div", {class: "screen", id: "screen", tabindex: "0", role: "region", "aria-label": "live screen"}, img, marks);
  const holder = h("p", {id: "holder", "aria-live": "polite"}, "connecting…");
  const rate = h("span", {id: "rate", class: "muted"});
  const take = h("button", {type: "button", id: "take"}, "Take over");
  const back = h("button", {type: "button", id: "hand-back", class: "secondary", hidden: true}, "Hand back");
  const log = h("ul", {class: "events", id: "actions", "aria-label": "desktop actions"});
  view(h("h1", {}, `Screen of ${name}`), h("p", {}, h("a", {href: `#/devices/${encodeURIComponent(name)}`}, "← device")),
    h("div", {class: "card"}, holder, h("div", {class: "row"}, take, back, rate)), box, h("h2", {}, "Desktop actions"), log);
  let stream = null; let size = null; let mine = false; let shots = 0; const t0 = performance.now();
  const es = new EventSource(base);
  S.streams.push(es);
  const showHolder = (who) => {
    mine = !!who && !!stream && who === S.me.name && box.dataset.held === "mine";
    holder.textContent = who ? `Held by ${who}: agents' desktop actions are refused.` : "The agent has the desktop.";
    box.dataset.holder = who || "";
    take.hidden = !!who && mine; back.hidden = !mine;
  };
  const mark = (e) => {  // a dot at the point, a box around an element's bounds; text set as text
    if (!size) return;
    const pct = (v, whole) => `${(100 * v / whole).toFixed(3)}%`;
    const el = h("div", {class: `mark${e.person ? " person" : ""}`, "data-tool": e.tool, "data-call": e.call_id || ""});
    if (e.bounds && e.bounds.width) {
      el.classList.add("bounds");
      Object.assign(el.style, {left: pct(e.bounds.x, size.width), top: pct(e.bounds.y, size.height),
        width: pct(e.bounds.width, size.width), height: pct(e.bounds.height, size.height)});
    } else if (typeof e.x === "number" && typeof e.y === "number") {
      Object.assign(el.style, {left: pct(e.x, size.width), top: pct(e.y, size.height)});
    } else return;
    el.append(h("span", {}, `${e.tool}${e.via ? ` via ${e.via}` : ""}`));
    marks.append(el);
    while (marks.children.length > 8) marks.firstChild.remove();
  };
  es.addEventListener("hello", (m) => { const d = JSON.parse(m.data); stream = d.stream; box.dataset.stream = stream; showHolder(d.holder); });
  es.addEventListener("frame", (m) => {
    const d = JSON.parse(m.data); shots += 1; size = d.screen || size;
    if (d.png) { img.src = `data:image/png;base64,${d.png}`; img.dataset.seq = String(d.seq); }
    box.dataset.shots = String(shots);
    rate.textContent = ` ${(shots / ((performance.now() - t0) / 1000)).toFixed(1)} frames/s`;
  });
  es.addEventListener("problem", (m) => { holder.textContent = `No picture: ${JSON.parse(m.data).error}`; });
  es.addEventListener("hold", (m) => { const d = JSON.parse(m.data); if (!d.holder || d.holder !== S.me.name) box.dataset.held = ""; showHolder(d.holder); });
  es.addEventListener("action", (m) => {
    const d = JSON.parse(m.data); const p = d.parameters || {};
    const where = typeof p.x === "number" ? ` at ${p.x},${p.y}` : "";
    log.prepend(h("li", {"data-call": d.call_id || ""}, h("strong", {}, d.tool), where, ` by ${d.by || "?"}`,
      p.text || p.key || p.label || p.name ? ` ${JSON.stringify(p.text || p.key || p.label || p.name).slice(0, 80)}` : ""));
    while (log.children.length > 50) log.lastChild.remove();
    if (typeof p.x === "number") mark({...d, x: p.x, y: p.y});
  });
  es.addEventListener("result", (m) => {
    const d = JSON.parse(m.data);
    const li = log.querySelector(`li[data-call="${CSS.escape(d.call_id || "")}"]`);
    if (li) li.append(` → ${d.status}${d.via ? ` via ${d.via}` : ""}${d.error ? `: ${d.error.slice(0, 200)}` : ""}`);
    if (d.status === "success") mark(d);
  });
  const post = (what, body) => api(`${base}/${what}`, {method: "POST", body: {stream, ...body}});
  // while holding, the page says every 5 s that it is still there (the server lets go after 20 s of silence)
  const keep = setInterval(() => { if (mine && document.body.contains(box)) post("keep").catch(() => {}); else if (!document.body.contains(box)) clearInterval(keep); }, 5000);
  take.addEventListener("click", () => post("take").then(() => { box.dataset.held = "mine"; showHolder(S.me.name); box.focus(); }, fail));
  back.addEventListener("click", () => post("release").then(() => { box.dataset.held = ""; showHolder(null); }, fail));
  let queue = Promise.resolve();  // one input at a time, in the order the person gave them
  const act = (tool, parameters) => { queue = queue.then(() => post("act", {tool, parameters})).then((r) => {
    if (r.result.status !== "success") toast(`${tool}: ${r.result.error}`);
  }, fail); };
  img.addEventListener("click", (e) => {
    if (!mine || !size) return;
    const r = img.getBoundingClientRect();
    act("click", {x: Math.round((e.clientX - r.left) * size.width / r.width), y: Math.round((e.clientY - r.top) * size.height / r.height)});
  });
  box.addEventListener("keydown", (e) => {
    if (!mine) return;
    if (KEYS[e.key]) { e.preventDefault(); act("press_key", {key: KEYS[e.key]}); }
    else if (e.key.length === 1 && !e.ctrlKey && !e.metaKey && !e.altKey) { e.preventDefault(); act("type_text", {text: e.key}); }
  });
  box.addEventListener("wheel", (e) => {
    if (!mine || !size) return;
    e.preventDefault();
    const r = img.getBoundingClientRect();
    act("scroll", {direction: e.deltaY > 0 ? "down" : "up", amount: 1, x: Math.round((e.clientX - r.left) * size.width / r.width),
      y: Math.round((e.clientY - r.top) * size.height / r.height)});
  }, {passive: false});
}
