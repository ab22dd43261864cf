// A task's file changes (loaded after app.js): per step, the files its commands changed, with a diff where
// the command carries the content (a file written: its lines added; appended: the lines added at the end),
// the device's unified diff where it sent one (an overwrite, a shell command's changed text files: `diff`,
// `added`, `removed`, `diff_truncated`, or `diff_skipped` saying why not) and the list the sandbox recorded
// for a shell command (created, modified, deleted, renamed, bytes).
// Text only: paths and content from the device go into the page with textContent, never as HTML.
"use strict";

const MAX_DIFF_LINES = 400;
function diffLines(text, mark) {
  const lines = String(text).split("\n"); if (lines.length && lines[lines.length - 1] === "") lines.pop();
  const shown = lines.slice(0, MAX_DIFF_LINES).map((l) => h("span", {class: mark === "+" ? "add" : "del"}, `${mark}${l}\n`));
  if (lines.length > MAX_DIFF_LINES) shown.push(h("span", {class: "muted"}, `… ${lines.length - MAX_DIFF_LINES} more line(s)\n`));
  return {count: lines.length, body: h("pre", {class: "diff"}, shown)};
}
// a unified diff from the device (tether.sandbox.layers.diff: bounded, text only): - and + lines coloured,
// hunk headers muted, each line a text node
function unifiedDiff(c) {
  const lines = String(c.diff).split("\n"); if (lines.length && lines[lines.length - 1] === "") lines.pop();
  const cls = (l, i) => i < 2 && /^(---|\+\+\+) /.test(l) ? "hdr" : l.startsWith("@@") ? "hunk" : l.startsWith("+") ? "add" : l.startsWith("-") ? "del" : l.startsWith("\\") ? "muted" : "ctx";
  const shown = lines.slice(0, MAX_DIFF_LINES).map((l, i) => h("span", {class: cls(l, i)}, `${l}\n`));
  if (lines.length > MAX_DIFF_LINES) shown.push(h("span", {class: "muted"}, `… ${lines.length - MAX_DIFF_LINES} more line(s)\n`));
  if (c.diff_truncated) shown.push(h("span", {class: "muted"}, "… the diff is cut here (64 KiB a file, 256 KiB a command)\n"));
  return {count: Number(c.added) || 0, removed: Number(c.removed) || 0, lines: lines.length, body: h("pre", {class: "diff"}, shown)};
}
const hasDiff = (c) => c && typeof c.diff === "string";
const skipped = (c) => c && c.diff_skipped ? `no diff: ${c.diff_skipped}` : null;
function fileEntry(kind, path, detail, diff, note) {
  const sign = {created: "A", modified: "M", deleted: "D", renamed: "R", appended: "M"}[kind] || "?";
  return h("details", {class: "file", "data-path": path, "data-kind": kind, open: diff && (diff.lines ?? diff.count) <= 40 ? true : null},
    h("summary", {}, h("span", {class: `fkind k-${kind}`, title: kind, "aria-label": kind}, sign), " ", h("code", {}, path),
      detail ? h("span", {class: "muted"}, ` ${detail}`) : null, diff ? h("span", {class: "plus"}, ` +${diff.count}`) : null,
      diff && diff.removed ? h("span", {class: "minus"}, ` −${diff.removed}`) : null),
    note ? h("p", {class: "muted small"}, note) : null, diff ? diff.body : null);
}
// one step attempt's changes, as file entries (none when it changed nothing it reports)
function stepChanges(r) {
  const p = (r.command && r.command.parameters) || {}; const out = (r.result && r.result.result) || {};
  const tool = String((r.command && r.command.tool_name) || "").replace(/^files\./, "");
  if (r.result.status !== "success" || out.needs_approval || out.preview) return [];
  if (tool === "write_file" && typeof p.content === "string") {
    const path = out.path || p.file_path;
    if (out.created || p.mode === undefined || p.mode === "create") return [fileEntry("created", path, `${out.bytes_written ?? ""} bytes`, diffLines(p.content, "+"))];
    if (p.mode === "append") return [fileEntry("appended", path, "appended", diffLines(p.content, "+"), "the lines added at its end")];
    if (hasDiff(out)) return [fileEntry("modified", path, "overwritten", unifiedDiff(out), "the previous content is in the device's undo journal (Undo puts it back)")];
    return [fileEntry("modified", path, "overwritten", diffLines(p.content, "+"), [skipped(out), "its new content; the previous one is in the device's undo journal (Undo puts it back)"].filter(Boolean).join(" · "))];
  }
  if (tool === "delete_file") return [fileEntry("deleted", out.path || p.path, out.type || "")];
  if (tool === "move_file") return [fileEntry("renamed", out.destination || p.destination, `from ${out.source || p.source}`)];
  return changeEntries(out.changes);
}
// the sandbox's record of a shell command's changes (tools/shell: Change.public), each text file with its diff;
// also a held change's (what approving would apply) and an overwrite waiting for approval (`would_change`)
function changeEntries(changes) {
  return (Array.isArray(changes) ? changes : []).filter((c) => c && c.path !== undefined).map((c) => fileEntry(c.kind, String(c.path),
    [c.type && c.type !== "file" ? c.type : "", c.from ? `from ${c.from}` : "", c.kind !== "deleted" && c.bytes !== undefined ? `${c.bytes} bytes` : ""].filter(Boolean).join(" · "),
    hasDiff(c) ? unifiedDiff(c) : null, skipped(c)));
}
// the task's changes: a section per step that changed something, or a line saying nothing changed
function taskChanges(t) {
  const parts = (t.steps || []).map((r) => [r, stepChanges(r)]).filter(([, files]) => files.length);
  const count = parts.reduce((n, [, files]) => n + files.length, 0);
  return h("section", {id: "changes", "aria-label": "changes"}, h("h2", {}, count ? `Changes (${count})` : "Changes"),
    count ? parts.map(([r, files]) => h("div", {class: "card", "data-changes-step": r.index},
      h("p", {}, h("strong", {}, `${r.index + 1}. ${r.step.skill}`), r.attempt > 1 ? h("span", {class: "muted"}, ` attempt ${r.attempt}`) : null), files))
      : h("p", {class: "empty muted"}, ["done", "failed", "cancelled"].includes(t.state) ? "This task changed no files." : "No file changes yet."));
}
// a held step (the policy asks a person first) waits: it has not failed
const heldForApproval = (r) => !!(r.result && r.result.result && r.result.result.needs_approval);
