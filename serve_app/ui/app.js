// The Alloy web console: hash routes, each rendering one view into <main id="view">. Live data comes from the
// job event stream (api.js followJob); every follower is stopped when the view changes.
import { api, ApiError, followJob, key } from "./api.js";
import { bar, h, lineChart, setBar, state, when } from "./dom.js";

const view = document.getElementById("view");
let followers = [];

function stopFollowing() {
  followers.forEach((stop) => stop());
  followers = [];
}

function follow(jobId, onEvent) {
  followers.push(followJob(jobId, onEvent));
}

function show(...children) {
  view.replaceChildren(...children);
}

function showError(error) {
  if (error instanceof ApiError && error.status === 401) { askForKey("That key was refused."); return; }
  show(h("p", { class: "error", id: "view-error" }, error.message));
}

function askForKey(message = "") {
  stopFollowing();
  const form = document.getElementById("key-form").content.cloneNode(true);
  show(form);
  document.getElementById("key-error").textContent = message;
  document.getElementById("key-entry").addEventListener("submit", (event) => {
    event.preventDefault();
    key.set(document.getElementById("key-input").value);
    route();
  });
}

// --- jobs list ------------------------------------------------------------------------------------------------
async function jobsView() {
  const page = await api("/jobs?limit=50");
  const rows = page.items.map((job) => {
    const progress = bar(job.percent);
    const stateCell = h("td", {}, state(job.state));
    const detail = h("td", { class: "muted" }, describe(job));
    const link = job.kind === "evolution" ? `#/evolutions/${job.job_id}` : `#/jobs/${job.job_id}`;
    const row = h("tr", { dataset: { job: job.job_id } },
      h("td", {}, h("a", { href: link }, job.job_id.slice(0, 12))), h("td", {}, job.kind), stateCell,
      h("td", {}, progress), detail, h("td", { class: "muted" }, when(job.created_at)));
    if (!["COMPLETED", "FAILED"].includes(job.state)) {
      follow(job.job_id, (event) => {
        const data = event.data || {};
        if (event.event === "state") stateCell.replaceChildren(state(data.to_state));
        if (event.event === "progress") { setBar(progress, data.percent); detail.textContent = describe(data); }
        if (event.event === "end") {
          stateCell.replaceChildren(state(data.state));
          setBar(progress, data.percent);
        }
      });
    }
    return row;
  });
  show(h("h2", {}, "Jobs"), h("p", {}, h("a", { href: "#/merge" }, "Start a merge"), " · ", h("a", { href: "#/evolve" }, "Start an evolution")),
       h("table", { id: "jobs" }, h("tr", {}, ["Job", "Kind", "State", "Progress", "", "Created"].map((t) => h("th", {}, t))),
         rows.length ? rows : h("tr", {}, h("td", { colspan: 6, class: "muted" }, "No jobs yet."))));
}

function describe(p) {
  const parts = [];
  if (p.tensors_total) parts.push(`tensors ${p.tensors_done || 0}/${p.tensors_total}`);
  if (p.bytes_done) parts.push(`${(p.bytes_done / 1e6).toFixed(1)} MB`);
  if (p.generation !== undefined && p.generation !== null) parts.push(`generation ${p.generation}`);
  if (typeof p.best_fitness === "number") parts.push(`best ${p.best_fitness.toPrecision(4)}`);
  if (typeof p.median_fitness === "number") parts.push(`median ${p.median_fitness.toPrecision(4)}`);
  return parts.join(" · ");
}

// --- one job ----------------------------------------------------------------------------------------------------
async function jobView(jobId) {
  const job = await api(`/jobs/${encodeURIComponent(jobId)}`);
  const stateEl = h("span", { id: "job-state" }, state(job.state));
  const progress = bar(job.percent);
  progress.id = "job-progress";
  const detail = h("p", { class: "muted", id: "job-detail" }, describe(job));
  const timeline = h("ol", { class: "timeline", id: "timeline" });
  const log = h("div", { class: "events", id: "events" });
  const result = h("div", { id: "job-result" }, resultOf(job));
  show(h("h2", {}, `Job ${job.job_id}`), h("div", { class: "card" },
         h("p", {}, `${job.kind} · `, stateEl, ` · created ${when(job.created_at)}`), progress, detail, result),
       h("h3", {}, "State timeline"), timeline, h("h3", {}, "Events"), log);
  follow(jobId, (event) => {
    const data = event.data || {};
    log.prepend(h("div", {}, `${event.id || ""} ${event.event} ${JSON.stringify(data)}`));
    if (event.event === "state") {
      timeline.append(h("li", { class: data.to_state }, `${data.to_state} ${new Date(data.at).toLocaleTimeString()}`));
      stateEl.replaceChildren(state(data.to_state));
    }
    if (event.event === "progress") { setBar(progress, data.percent); detail.textContent = describe(data); }
    if (event.event === "end") {
      stateEl.replaceChildren(state(data.state));
      if (data.state === "COMPLETED") setBar(progress, 100);
      api(`/jobs/${encodeURIComponent(jobId)}`).then((fresh) => result.replaceChildren(resultOf(fresh)));
    }
  });
}

function resultOf(job) {
  if (job.state === "FAILED" && job.error) return h("p", { class: "error" }, `${job.error.code}: ${job.error.message}`);
  if (job.model_id) return h("p", {}, "Merged model: ", h("a", { href: `#/models/${job.model_id}`, id: "result-model" }, job.model_id));
  return "";
}

// --- evolution --------------------------------------------------------------------------------------------------
async function evolutionView(jobId) {
  const status = await api(`/evolutions/${encodeURIComponent(jobId)}`);
  const stateEl = h("span", {}, state(status.state));
  const summary = h("p", { class: "muted" }, describe(status));
  const chartBox = h("div", { id: "fitness-chart" });
  const table = h("table", { id: "trials" });
  const refresh = async () => {
    const { trials } = await api(`/evolutions/${encodeURIComponent(jobId)}/trials`);
    chartBox.replaceChildren(lineChart(fitnessSeries(trials)));
    table.replaceChildren(h("tr", {}, ["Trial", "Generation", "Fitness", "Parent", "Genome"].map((t) => h("th", {}, t))),
      ...trials.map((t) => h("tr", {}, h("td", {}, t.trial_id), h("td", {}, t.generation),
        h("td", {}, fmt((t.metrics || {}).fitness)), h("td", {}, t.parent_trial || ""),
        h("td", { class: "muted" }, JSON.stringify(t.genome)))));
  };
  const result = h("div", { id: "evolution-result" }, resultOf(status.result ? { ...status, ...status.result } : status));
  show(h("h2", {}, `Evolution ${jobId}`), h("div", { class: "card" }, h("p", {}, stateEl), summary, result),
       h("h3", {}, "Fitness over generations (best, median)"), chartBox, h("h3", {}, "Trials"), table);
  await refresh();
  follow(jobId, (event) => {
    const data = event.data || {};
    if (event.event === "state") stateEl.replaceChildren(state(data.to_state));
    if (event.event === "progress") { summary.textContent = describe(data); refresh(); }
    if (event.event === "end") {
      stateEl.replaceChildren(state(data.state));
      refresh();
      api(`/evolutions/${encodeURIComponent(jobId)}`).then((fresh) =>
        result.replaceChildren(resultOf(fresh.result ? { ...fresh, ...fresh.result } : fresh)));
    }
  });
}

// --- evolution form ---------------------------------------------------------------------------------------------
// The request is the API's own (POST /evolutions, the same document `ray job submit` takes): JSON here, checked by
// the server, whose structured error is shown as it comes.
const EXAMPLE_EVOLUTION = {
  name: "my-evolution",
  preset: "tiny",
  strategy: "task_arithmetic",
  genome: { per_model: { weight: [0.0, 1.5, 1.0] }, global_parameters: { lambda: [0.1, 1.5, 0.5] } },
  search: { kind: "pbt", population: 3, generations: 3, seed: 0 },
};

function evolveView() {
  const request = h("textarea", { id: "evolution-request", rows: 16, spellcheck: "false" });
  request.value = JSON.stringify(EXAMPLE_EVOLUTION, null, 2);
  const form = h("form", { id: "evolution-form", class: "card", novalidate: true },
    h("label", { for: "evolution-request" }, "Evolution request (JSON, as POST /evolutions takes it; see /docs)"),
    request,
    h("p", { class: "error", id: "evolution-error" }),
    h("button", { type: "submit", id: "evolution-submit" }, "Start evolution"));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const error = document.getElementById("evolution-error");
    let body;
    try { body = JSON.parse(request.value); }
    catch { error.textContent = "VALIDATION_FAILED: the request must be a JSON object"; return; }
    if (body === null || typeof body !== "object" || Array.isArray(body)) {
      error.textContent = "VALIDATION_FAILED: the request must be a JSON object"; return;
    }
    try {
      const accepted = await api("/evolutions", { method: "POST", body });
      location.hash = `#/evolutions/${accepted.job_id}`;
    } catch (failure) {
      error.textContent = failure.message;
    }
  });
  show(h("h2", {}, "New evolution"), form);
}

function fmt(value) {
  return typeof value === "number" ? value.toPrecision(4) : "";
}

function fitnessSeries(trials) {
  const byGeneration = new Map();
  for (const t of trials) {
    const f = (t.metrics || {}).fitness;
    if (typeof f !== "number") continue;
    if (!byGeneration.has(t.generation)) byGeneration.set(t.generation, []);
    byGeneration.get(t.generation).push(f);
  }
  const generations = [...byGeneration.keys()].sort((a, b) => a - b);
  const median = (xs) => { const s = [...xs].sort((a, b) => a - b); const m = s.length >> 1; return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2; };
  return [
    { name: "best", points: generations.map((g) => [g, Math.max(...byGeneration.get(g))]) },
    { name: "median", points: generations.map((g) => [g, median(byGeneration.get(g))]) },
  ];
}

// --- models -----------------------------------------------------------------------------------------------------
async function modelsView() {
  const page = await api("/models?limit=200");
  show(h("h2", {}, "Models"), h("table", { id: "models" },
    h("tr", {}, ["Model", "Architecture", "Parameters", "Size", "Created"].map((t) => h("th", {}, t))),
    page.items.map((m) => h("tr", {}, h("td", {}, h("a", { href: `#/models/${m.id}` }, m.id)), h("td", {}, m.architecture || ""),
      h("td", {}, m.parameter_count ?? ""), h("td", {}, m.size_bytes ? `${(m.size_bytes / 1e6).toFixed(1)} MB` : ""),
      h("td", { class: "muted" }, when(m.created_at))))));
}

async function modelView(modelId) {
  const model = await api(`/models/${modelId}`);
  const files = await api(`/artifacts?prefix=${encodeURIComponent((model.artifact_prefix || `models/${modelId}`).replace(/\/?$/, "/"))}`);
  const lineage = model.lineage || {};
  show(h("h2", {}, `Model ${model.id}`),
    h("div", { class: "card" }, h("p", {}, `${model.architecture || ""} · ${model.parameter_count ?? "?"} parameters · ${model.num_layers ?? "?"} layers`),
      h("p", { class: "muted" }, `fingerprint ${model.fingerprint || ""}`)),
    h("h3", {}, "Lineage"), lineageOf(lineage),
    h("h3", {}, "Files"), h("table", { id: "files" }, files.map((f) => h("tr", { dataset: { file: f.key.split("/").pop() } },
      h("td", {}, f.key.split("/").pop()), h("td", {}, `${f.size} bytes`),
      h("td", {}, h("button", { type: "button", onclick: () => download(f) }, "Download"))))));
}

function lineageOf(lineage) {
  if (!Object.keys(lineage).length) return h("p", { class: "muted", id: "lineage" }, "Registered directly (no lineage).");
  const parents = (lineage.recipe && lineage.recipe.models || []).map((m) => m.model || m);
  return h("div", { class: "card", id: "lineage" },
    lineage.job_id ? h("p", {}, "Made by job ", h("a", { href: `#/jobs/${lineage.job_id}` }, lineage.job_id)) : "",
    parents.length ? h("p", {}, "Parents: ", parents.flatMap((p, i) => [i ? ", " : "", h("a", { href: `#/models/${p}` }, p)])) : "",
    h("pre", { class: "events" }, JSON.stringify(lineage, null, 2)));
}

// The download needs the Authorization header, so it is fetched and handed to the browser as a blob.
async function download(file) {
  const response = await fetch(`/artifacts/${file.key}/content`, { headers: { Authorization: `Bearer ${key.get()}` } });
  if (!response.ok) { showError(new ApiError(response.status, await response.json().catch(() => null))); return; }
  const url = URL.createObjectURL(await response.blob());
  const link = h("a", { href: url, download: file.key.split("/").pop() });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

// --- merge form -------------------------------------------------------------------------------------------------
// The rules come from the API's own schema (MergeRequest in /openapi.json), so the form validates like the API.
async function mergeView() {
  const [spec, models] = await Promise.all([api("/openapi.json"), api("/models?limit=500")]);
  const schema = spec.components.schemas.MergeRequest;
  const fields = schema.properties;
  const strategies = fields.strategy.description.split("|").map((s) => s.trim());
  const idPattern = new RegExp(fields.output_model_id.pattern);
  const ids = models.items.map((m) => m.id);
  const form = h("form", { id: "merge-form", class: "card", novalidate: true },
    h("label", { for: "models" }, `Models (${fields.models.minItems}-${fields.models.maxItems})`),
    h("select", { id: "models", multiple: true, size: Math.min(8, Math.max(3, ids.length)) }, ids.map((id) => h("option", { value: id }, id))),
    h("label", { for: "strategy" }, "Strategy"),
    h("select", { id: "strategy" }, strategies.map((s) => h("option", { value: s }, s))),
    h("label", { for: "base" }, "Base model (ties, dare, task_arithmetic)"),
    h("select", { id: "base" }, h("option", { value: "" }, "(none)"), ids.map((id) => h("option", { value: id }, id))),
    h("label", { for: "parameters" }, "Parameters (JSON object)"),
    h("input", { id: "parameters", value: "{}" }),
    h("label", { for: "output" }, "Output model id"),
    h("input", { id: "output", required: true }),
    h("p", { class: "error", id: "merge-error" }),
    h("button", { type: "submit", id: "merge-submit" }, "Start merge"));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const error = document.getElementById("merge-error");
    const body = {
      models: [...document.getElementById("models").selectedOptions].map((o) => o.value),
      strategy: document.getElementById("strategy").value,
      output_model_id: document.getElementById("output").value.trim(),
    };
    const base = document.getElementById("base").value;
    if (base) body.base_model = base;
    const problem = checkMerge(body, fields, idPattern);
    if (problem) { error.textContent = problem; return; }
    try { body.parameters = JSON.parse(document.getElementById("parameters").value || "{}"); }
    catch { error.textContent = "VALIDATION_FAILED: parameters must be a JSON object"; return; }
    try {
      const accepted = await api("/merge/execute", { method: "POST", body });
      location.hash = `#/jobs/${accepted.job_id}`;
    } catch (failure) {
      error.textContent = failure.message;  // the server's code and message, e.g. INCOMPATIBLE_MODELS: ...
    }
  });
  show(h("h2", {}, "New merge"), form);
}

function checkMerge(body, fields, idPattern) {
  const { minItems, maxItems } = fields.models;
  if (body.models.length < minItems || body.models.length > maxItems)
    return `VALIDATION_FAILED: choose ${minItems} to ${maxItems} models`;
  if (!idPattern.test(body.output_model_id)) return "VALIDATION_FAILED: output model id: letters, digits, . _ - (one / at most)";
  if (body.models.includes(body.output_model_id)) return "VALIDATION_FAILED: the output id must differ from the input models";
  return null;
}

// --- routing ----------------------------------------------------------------------------------------------------
const ROUTES = [
  [/^#\/jobs\/(.+)$/, jobView],
  [/^#\/evolutions\/(.+)$/, evolutionView],
  [/^#\/models\/(.+)$/, modelView],
  [/^#\/models$/, modelsView],
  [/^#\/merge$/, mergeView],
  [/^#\/evolve$/, evolveView],
  [/^.*$/, jobsView],
];

async function route() {
  stopFollowing();
  document.getElementById("forget-key").hidden = !key.get();
  if (!key.get()) { askForKey(); return; }
  const hash = location.hash || "#/jobs";
  for (const [pattern, render] of ROUTES) {
    const match = hash.match(pattern);
    if (!match) continue;
    try { await render(...match.slice(1).map(decodeURIComponent)); }
    catch (error) { showError(error); }
    return;
  }
}

document.getElementById("forget-key").addEventListener("click", () => { key.clear(); route(); });
window.addEventListener("hashchange", route);
route();
