// tandem console: a chat playground over /v1/chat/completions and a live view of /v1/cluster.
// Plain browser JavaScript, no libraries: the server embeds this file and serves it as it is.
"use strict";

const KEY_STORAGE = "tandem.apiKey";
const POLL_MS = 2000;
const HISTORY_MS = 5 * 60 * 1000;
const COLORS = ["#2f6fdb", "#d9822b", "#1d8a4a", "#a23bc4"];

const $ = (id) => document.getElementById(id);

// ---- API key -------------------------------------------------------------------------------------
// The page loads without the key; the API routes keep theirs. A 401 opens the key form; the key lives in
// sessionStorage (this tab only) and goes out as a bearer token on every fetch.

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function authHeaders(extra) {
  const headers = Object.assign({}, extra);
  const key = apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

function askForKey(reason) {
  $("key-reason").textContent = reason;
  $("key-form").hidden = false;
  $("key-input").focus();
}

function setUpKeyForm() {
  $("key-button").addEventListener("click", () => askForKey("Set the API key this page sends."));
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    $("key-input").value = "";
    $("key-form").hidden = true;
    loadModels();
    poll.now();
  });
  $("key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    $("key-form").hidden = true;
    poll.now();
  });
}

// The message of an OpenAI-shaped error body, or the status line.
async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) {
    // Not JSON: the status says enough.
  }
  return response.status + " " + response.statusText;
}

// ---- formatting ----------------------------------------------------------------------------------

function fmtNumber(x, digits) {
  if (x === null || x === undefined || !isFinite(x)) return "–";
  return x.toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

function fmtBytes(bytes) {
  if (!isFinite(bytes)) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (bytes >= 1000 && i < units.length - 1) {
    bytes /= 1000;
    i += 1;
  }
  return fmtNumber(bytes, i === 0 ? 0 : 1) + " " + units[i];
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// ---- chat ----------------------------------------------------------------------------------------

const chat = {
  history: [], // {role, content} of finished turns
  controller: null, // the AbortController of the answer streaming now
  generation: 0, // bumped by Clear, so an answer cut short by it stays out of the new history
};

async function loadModels() {
  try {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    if (response.status === 401) return; // the cluster poll asks for the key
    if (!response.ok) return;
    const list = await response.json();
    const select = $("model");
    const chosen = select.value;
    select.replaceChildren();
    for (const model of list.data || []) {
      const option = el("option", "", model.id);
      option.value = model.id;
      select.appendChild(option);
    }
    if (chosen) select.value = chosen;
  } catch (_) {
    // The poll reports the server unreachable.
  }
}

function addMessage(role, text) {
  const box = el("div", "msg " + role);
  const content = el("div", "content", text);
  box.appendChild(content);
  $("messages").appendChild(box);
  box.scrollIntoView({ block: "end" });
  return { box, content };
}

function setStreaming(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

// Reads an SSE body, calling onEvent with each `data:` payload (parsed JSON, or "[DONE]").
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const event = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      onEvent(data === "[DONE]" ? data : JSON.parse(data));
    }
  }
}

async function send() {
  const input = $("chat-input");
  const text = input.value.trim();
  if (!text || chat.controller) return;
  input.value = "";
  addMessage("user", text);
  chat.history.push({ role: "user", content: text });

  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...chat.history);
  const body = {
    model: $("model").value || $("model-name").textContent,
    messages,
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
    stream: true,
    stream_options: { include_usage: true },
  };

  const answer = addMessage("assistant", "");
  const stats = el("div", "stats", "waiting for the first token…");
  answer.box.appendChild(stats);
  chat.controller = new AbortController();
  const generation = chat.generation;
  setStreaming(true);

  const started = performance.now();
  let firstAt = null;
  let lastAt = null;
  let chunks = 0;
  let completionTokens = null;
  let finish = null;
  let failure = null;
  let reply = "";
  // A reasoning model's thinking (`reasoning_content`), shown folded above the answer and never sent back.
  let thinking = null;
  const think = (text) => {
    if (!thinking) {
      const box = el("details", "thinking");
      box.open = true;
      box.appendChild(el("summary", "", "thinking"));
      thinking = el("div", "content", "");
      box.appendChild(thinking);
      answer.box.insertBefore(box, answer.content);
    }
    thinking.textContent += text;
  };
  const showStats = () => {
    const parts = [];
    if (firstAt !== null) parts.push("TTFT " + fmtNumber(firstAt - started, 0) + " ms");
    const tokens = completionTokens !== null ? completionTokens : chunks;
    parts.push(tokens + " tokens");
    // Decode speed: tokens after the first over the time after the first.
    if (firstAt !== null && lastAt > firstAt && tokens > 1) {
      parts.push(fmtNumber(((tokens - 1) * 1000) / (lastAt - firstAt), 1) + " tok/s");
    }
    if (finish) parts.push("finish: " + finish);
    stats.textContent = parts.join(" · ");
  };

  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(body),
      signal: chat.controller.signal,
    });
    if (response.status === 401) askForKey("The server refused the API key: enter it to chat.");
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, (event) => {
      if (event === "[DONE]") return;
      if (event.error) throw new Error(event.error.message || "the server ended the stream with an error");
      if (event.usage) completionTokens = event.usage.completion_tokens;
      for (const choice of event.choices || []) {
        const delta = choice.delta || {};
        const piece = (delta.content || "") + (delta.tool_calls ? JSON.stringify(delta.tool_calls) : "");
        const thought = delta.reasoning_content || "";
        if (piece || thought) {
          const now = performance.now();
          if (firstAt === null) firstAt = now;
          lastAt = now;
          chunks += 1;
        }
        if (thought) think(thought);
        if (piece) {
          reply += piece;
          answer.content.textContent = reply;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      showStats();
      answer.box.scrollIntoView({ block: "end" });
    });
    if (!finish) failure = "the stream ended before the answer finished";
  } catch (error) {
    if (error.name === "AbortError") {
      finish = "stopped";
    } else {
      failure = error.message;
    }
  }
  chat.controller = null;
  setStreaming(false);
  showStats();
  if (failure) {
    answer.box.classList.add("failed");
    answer.content.textContent = reply + (reply ? "\n" : "") + "Error: " + failure;
  }
  if (generation === chat.generation) {
    if (reply) chat.history.push({ role: "assistant", content: reply });
    else chat.history.pop(); // a turn without an answer is not sent again
  }
  input.focus();
}

function setUpChat() {
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("clear").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
    chat.generation += 1;
    chat.history = [];
    $("messages").replaceChildren();
  });
}

// ---- deployment view -----------------------------------------------------------------------------

const samples = []; // {t, snapshot} of recent polls, oldest first
const series = {
  ttftMean: [],
  ttftP90: [],
  itlMean: [],
  itlP90: [],
  genRate: [],
  promptRate: [],
  kvRate: [],
};

// Increase of a cumulative counter between two snapshots; a restart (the value went down) counts from 0.
function increase(now, before) {
  if (before === undefined || before === null) return 0;
  return now >= before ? now - before : now;
}

// A quantile of the observations between two cumulative histogram snapshots, interpolated inside
// the bucket as Prometheus's histogram_quantile does; null without observations.
function quantileBetween(now, before, q) {
  const count = now.count - (before ? before.count : 0);
  if (count <= 0) return null;
  const beforeAt = new Map((before ? before.buckets : []).map(([le, c]) => [le, c]));
  const rank = q * count;
  let lower = 0;
  let below = 0;
  for (const [le, cumulative] of now.buckets) {
    const atOrBelow = cumulative - (beforeAt.get(le) || 0); // observations of the window up to le
    if (atOrBelow >= rank) {
      const inBucket = atOrBelow - below;
      return inBucket > 0 ? lower + ((le - lower) * (rank - below)) / inBucket : le;
    }
    lower = le;
    below = atOrBelow;
  }
  return lower; // in the +Inf bucket: the largest finite bound, as Prometheus answers
}

function meanBetween(now, before) {
  const count = now.count - (before ? before.count : 0);
  if (count <= 0) return null;
  return (now.sum - (before ? before.sum : 0)) / count;
}

// Sum of a per-worker counter over the workers of some roles, keyed by worker id for restarts.
function workerIncrease(now, before, field, roles) {
  const old = new Map((before ? before.workers : []).map((w) => [w.id, w]));
  let total = 0;
  for (const w of now.workers) {
    if (!roles.includes(w.role)) continue;
    const prev = old.get(w.id);
    if (prev) total += increase(w[field], prev[field]);
  }
  return total;
}

function push(name, t, value) {
  const points = series[name];
  points.push({ t, v: value });
  while (points.length && points[0].t < t - HISTORY_MS) points.shift();
}

function record(t, snapshot) {
  const previous = samples.length ? samples[samples.length - 1] : null;
  samples.push({ t, snapshot });
  while (samples.length > 2) samples.shift();
  if (!previous) return null;
  const dt = (t - previous.t) / 1000;
  const before = previous.snapshot;
  const latency = snapshot.latency || {};
  const beforeLatency = before.latency || {};
  const ms = (x) => (x === null ? null : x * 1000);
  const genRoles = ["decode", "colocated"];
  const rates = {
    rps: increase(latency.e2e ? latency.e2e.count : 0, beforeLatency.e2e ? beforeLatency.e2e.count : 0) / dt,
    gen: workerIncrease(snapshot, before, "generation_tokens_total", genRoles) / dt,
    // Every request is admitted by exactly one decode (or colocated) worker: its prompt counts there once.
    prompt: workerIncrease(snapshot, before, "prompt_tokens_total", genRoles) / dt,
    kv: increase(snapshot.kv_bytes_moved, before.kv_bytes_moved) / dt,
    workers: new Map(),
  };
  const old = new Map(before.workers.map((w) => [w.id, w]));
  for (const w of snapshot.workers) {
    const prev = old.get(w.id);
    if (!prev) continue;
    rates.workers.set(w.id, {
      prompt: increase(w.prompt_tokens_total, prev.prompt_tokens_total) / dt,
      gen: increase(w.generation_tokens_total, prev.generation_tokens_total) / dt,
    });
  }
  if (latency.ttft) {
    push("ttftMean", t, ms(meanBetween(latency.ttft, beforeLatency.ttft)));
    push("ttftP90", t, ms(quantileBetween(latency.ttft, beforeLatency.ttft, 0.9)));
  }
  if (latency.itl) {
    push("itlMean", t, ms(meanBetween(latency.itl, beforeLatency.itl)));
    push("itlP90", t, ms(quantileBetween(latency.itl, beforeLatency.itl, 0.9)));
  }
  push("genRate", t, rates.gen);
  push("promptRate", t, rates.prompt);
  push("kvRate", t, rates.kv / 1e6);
  return rates;
}

function workerState(w) {
  if (!w.healthy) return ["down", "state-down"];
  if (w.draining) return ["draining", "state-draining"];
  return ["healthy", "state-ok"];
}

function renderWorkers(snapshot, rates) {
  const body = $("workers").tBodies[0];
  body.replaceChildren();
  for (const w of snapshot.workers) {
    const row = el("tr");
    row.dataset.role = w.role;
    row.dataset.worker = w.id;
    const [state, stateClass] = workerState(w);
    const used = w.kv_blocks_total ? w.kv_blocks_used / w.kv_blocks_total : 0;
    const bar = el("span", "bar");
    const fill = el("span");
    fill.style.width = Math.min(100, used * 100).toFixed(1) + "%";
    bar.appendChild(fill);
    const kv = el("td");
    kv.append(bar, w.kv_blocks_used + " / " + w.kv_blocks_total);
    const r = rates && rates.workers.get(w.id);
    row.append(
      el("td", "id", w.id),
      el("td", "role", w.role),
      el("td", "address", w.address ? w.address.replace(/^[a-z]+:\/\//, "") : "(this process)"),
      el("td", stateClass, state),
      el("td", "", w.running + " / " + w.waiting),
      kv,
      el("td", "", String(w.pinned_blocks)),
      el("td", "", w.prefix_cache_hit_rate === null ? "–" : fmtNumber(w.prefix_cache_hit_rate * 100, 1) + "%"),
      el("td", "", r ? fmtNumber(r.prompt, 1) : "–"),
      el("td", "", r ? fmtNumber(r.gen, 1) : "–"),
    );
    row.cells[0].title = w.id;
    row.cells[2].title = w.address;
    body.appendChild(row);
  }
}

function renderSummary(snapshot, rates) {
  $("model-name").textContent = snapshot.model;
  if (!$("model").value && snapshot.model) {
    const option = el("option", "", snapshot.model);
    option.value = snapshot.model;
    $("model").appendChild(option);
  }
  const routing = snapshot.routing;
  $("routing").textContent = routing.remote + " / " + routing.local + " / " + routing.fallback;
  $("kv-moved").textContent = fmtBytes(snapshot.kv_bytes_moved);
  if (rates) {
    $("rps").textContent = fmtNumber(rates.rps, 2);
    $("gen-rate").textContent = fmtNumber(rates.gen, 1);
    $("kv-rate").textContent = fmtBytes(rates.kv) + "/s";
  }
}

function setStatus(text, kind) {
  const status = $("status");
  status.textContent = text;
  status.className = "status " + kind;
}

const poll = {
  timer: null,
  async run() {
    clearTimeout(poll.timer);
    try {
      const response = await fetch("/v1/cluster", { headers: authHeaders() });
      if (response.status === 401) {
        setStatus("API key needed", "error");
        askForKey(apiKey() ? "The server refused this API key." : "This server asks for its API key.");
        return; // resumes when a key is entered
      }
      if (!response.ok) throw new Error(await errorMessage(response));
      const snapshot = await response.json();
      const t = Date.now();
      const rates = record(t, snapshot);
      renderSummary(snapshot, rates);
      renderWorkers(snapshot, rates);
      drawCharts(t);
      setStatus("live · " + new Date(t).toLocaleTimeString(), "ok");
    } catch (error) {
      setStatus("unreachable: " + error.message, "error");
    }
    poll.timer = setTimeout(poll.run, POLL_MS);
  },
  now() {
    poll.run();
  },
};

// ---- charts --------------------------------------------------------------------------------------

// A round number at or above x (1, 2 or 5 times a power of ten); 0.5 for nothing to show.
function niceCeiling(x) {
  if (!(x > 0)) return 0.5;
  const power = Math.pow(10, Math.floor(Math.log10(x)));
  for (const step of [1, 2, 5, 10]) {
    if (x <= step * power) return step * power;
  }
  return 10 * power;
}

// Draws lines of {t, v} points (v null leaves a gap) over the last HISTORY_MS on a canvas.
function drawChart(canvas, lines, now) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const style = getComputedStyle(document.body);
  const muted = style.getPropertyValue("--muted").trim();
  const grid = style.getPropertyValue("--line").trim();
  const left = 48;
  const right = 16;
  const top = 18;
  const bottom = 18;
  const plotW = width - left - right;
  const plotH = height - top - bottom;
  let highest = 0;
  for (const line of lines) for (const p of line.points) if (p.v !== null) highest = Math.max(highest, p.v);
  // Four grid steps of 1, 2 or 5 times a power of ten, so every label is a round number.
  const step = niceCeiling(highest / 4);
  const max = step * 4;
  const digits = step >= 1 ? 0 : Math.ceil(-Math.log10(step) - 1e-9);
  const x = (t) => left + ((t - (now - HISTORY_MS)) / HISTORY_MS) * plotW;
  const y = (v) => top + plotH - (v / max) * plotH;

  ctx.font = "11px system-ui, sans-serif";
  ctx.lineWidth = 1;
  ctx.strokeStyle = grid;
  ctx.fillStyle = muted;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i += 1) {
    const v = (max * i) / 4;
    ctx.beginPath();
    ctx.moveTo(left, Math.round(y(v)) + 0.5);
    ctx.lineTo(left + plotW, Math.round(y(v)) + 0.5);
    ctx.stroke();
    ctx.fillText(fmtNumber(v, digits), left - 4, y(v));
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (let minutes = 5; minutes >= 0; minutes -= 1) {
    ctx.fillText(minutes === 0 ? "now" : "-" + minutes + "m", x(now - minutes * 60000), top + plotH + 4);
  }

  let legendX = left;
  ctx.textAlign = "left";
  ctx.textBaseline = "top";
  lines.forEach((line, i) => {
    const color = COLORS[i % COLORS.length];
    ctx.fillStyle = color;
    ctx.fillRect(legendX, 4, 10, 3);
    ctx.fillStyle = muted;
    ctx.fillText(line.name, legendX + 14, 0);
    legendX += 24 + ctx.measureText(line.name).width;
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let drawing = false;
    for (const p of line.points) {
      if (p.v === null) {
        drawing = false;
        continue;
      }
      if (drawing) ctx.lineTo(x(p.t), y(p.v));
      else ctx.moveTo(x(p.t), y(p.v));
      drawing = true;
    }
    ctx.stroke();
    // A lone point between gaps has no segment: mark it.
    ctx.fillStyle = color;
    line.points.forEach((p, j) => {
      const prev = line.points[j - 1];
      const next = line.points[j + 1];
      if (p.v !== null && (!prev || prev.v === null) && (!next || next.v === null)) {
        ctx.fillRect(x(p.t) - 1.5, y(p.v) - 1.5, 3, 3);
      }
    });
  });
}

function drawCharts(now) {
  drawChart($("chart-ttft"), [
    { name: "mean", points: series.ttftMean },
    { name: "p90", points: series.ttftP90 },
  ], now);
  drawChart($("chart-itl"), [
    { name: "mean", points: series.itlMean },
    { name: "p90", points: series.itlP90 },
  ], now);
  drawChart($("chart-throughput"), [
    { name: "generated", points: series.genRate },
    { name: "prompt", points: series.promptRate },
  ], now);
  drawChart($("chart-kv"), [{ name: "pulled by decode workers", points: series.kvRate }], now);
}

// ---- start ---------------------------------------------------------------------------------------

setUpKeyForm();
setUpChat();
loadModels();
poll.now();
window.addEventListener("resize", () => drawCharts(Date.now()));
