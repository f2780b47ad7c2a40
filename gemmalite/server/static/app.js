// The gemmalite chat page: plain JavaScript over this server's own OpenAI-compatible API.
// Everything a model (or a stored conversation) says is put into the page with textContent,
// never as HTML; the server's Content-Security-Policy forbids inline scripts besides.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = { chat: "gemmalite.chat", settings: "gemmalite.settings", key: "gemmalite.key" };
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "tools", "tool_choice"];

const ui = {
  caps: null,
  key: localStorage.getItem(STORE.key) || "",
  messages: [],      // {role, text, media: [{kind, url, name, format?}], reasoning, tools, finish, error}
  pending: [],       // attachments for the next message
  controller: null,  // AbortController of the reply being streamed
  embed: { images: [], query: null },  // the embeddings tab's pictures: documents, and the query's
};

// -- small DOM helpers (text only) ---------------------------------------------------------
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function setStatus(text, isError) {
  const s = $("status");
  s.textContent = text || "";
  s.classList.toggle("error", !!isError);
}

// -- the API ----------------------------------------------------------------------------
class KeyNeeded extends Error {}

async function api(path, body, signal) {
  const headers = {};
  if (ui.key) headers.Authorization = "Bearer " + ui.key;
  const init = { method: body === undefined ? "GET" : "POST", headers, signal };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const r = await fetch(path, init);
  if (r.status === 401) {
    askKey(ui.key ? "The server refused this key." : "");
    throw new KeyNeeded("an API key is needed");
  }
  if (!r.ok) {
    let msg = r.status + " " + r.statusText;
    try {
      const j = await r.json();
      if (j && j.error && j.error.message) msg = j.error.message;
    } catch (_) { /* not JSON */ }
    throw new Error(msg);
  }
  return r;
}

function askKey(error) {
  const err = $("key-error");
  err.textContent = error || "";
  err.hidden = !error;
  const d = $("key-dialog");
  if (!d.open) d.showModal();
  $("key-input").focus();
}

// -- capabilities -----------------------------------------------------------------------
async function start() {
  let caps;
  try {
    caps = await (await api("/v1/capabilities")).json();
  } catch (e) {
    if (!(e instanceof KeyNeeded)) setStatus("cannot reach the server: " + e.message, true);
    return;
  }
  ui.caps = caps;
  $("model-name").textContent = caps.model || "";
  $("image-label").hidden = !caps.vision;
  $("audio-label").hidden = !caps.audio;
  $("record").hidden = !(caps.audio && navigator.mediaDevices && window.MediaRecorder);
  $("think-label").hidden = !caps.thinking;
  $("tools-box").hidden = !caps.tools;
  for (const e of document.querySelectorAll(".embed-pics")) e.hidden = !caps.embedding_images;
  $("tab-embed").hidden = !caps.embeddings;
  $("forget-key").hidden = !ui.key;
  const cap = (caps.limits || {}).max_tokens;
  if (cap) {  // the field offers no more than the server allows
    $("max_tokens").max = String(cap);
    if (parseInt($("max_tokens").value, 10) > cap) $("max_tokens").value = String(cap);
  }
  const takes = ["text"].concat(caps.vision ? ["pictures"] : [], caps.audio ? ["audio"] : []);
  $("caps").textContent = `Takes ${takes.join(", ")}; context ${caps.context} tokens` +
    (caps.embedder ? `; embedder ${caps.embedder}` : "") + ".";
  document.body.dataset.ready = "1";
  setStatus("");
}

// -- settings and the stored conversation -------------------------------------------------
function loadSettings() {
  let s = {};
  try { s = JSON.parse(localStorage.getItem(STORE.settings) || "{}") || {}; } catch (_) { s = {}; }
  for (const k of SETTINGS) if (typeof s[k] === "string") $(k).value = s[k];
  $("think").checked = !!s.think;
}

function saveSettings() {
  const s = { think: $("think").checked };
  for (const k of SETTINGS) s[k] = $(k).value;
  localStorage.setItem(STORE.settings, JSON.stringify(s));
}

function loadChat() {
  try {
    const m = JSON.parse(localStorage.getItem(STORE.chat) || "[]");
    ui.messages = Array.isArray(m) ? m.filter((x) => x && (x.role === "user" || x.role === "assistant")) : [];
  } catch (_) {
    ui.messages = [];
  }
}

function saveChat() {
  try {
    localStorage.setItem(STORE.chat, JSON.stringify(ui.messages));
  } catch (_) {  // over the browser's quota: keep the words, drop the media
    const slim = ui.messages.map((m) => ({ ...m, media: (m.media || []).map((x) => ({ kind: x.kind, name: x.name })) }));
    try { localStorage.setItem(STORE.chat, JSON.stringify(slim)); } catch (_) { /* nothing to do */ }
    setStatus("the attachments are too large to keep in this browser: only the text is kept", true);
  }
}

// -- rendering ----------------------------------------------------------------------------
function renderAll() {
  const box = $("messages");
  box.replaceChildren();
  if (!ui.messages.length) box.append(el("p", "muted", "Type a message to start."));
  ui.messages.forEach((m, i) => box.append(renderMessage(m, i)));
  $("regenerate").disabled = !!ui.controller || !ui.messages.some((m) => m.role === "user");
  box.scrollTop = box.scrollHeight;
}

function renderMessage(m, i) {
  const div = el("div", "msg " + m.role);
  div.dataset.index = String(i);
  div.append(el("div", "who", m.role === "user" ? "You" : "Model"));
  for (const x of m.media || []) {
    if (x.kind === "image" && x.url) {
      const img = el("img", "thumb");
      img.src = x.url;
      img.alt = x.name || "picture";
      div.append(img);
    } else if (x.kind === "audio" && x.url) {
      const a = el("audio");
      a.controls = true;
      a.src = x.url;
      div.append(a);
    } else {
      div.append(el("div", "muted", `[${x.kind}${x.name ? ": " + x.name : ""} not kept]`));
    }
  }
  if (m.reasoning) {
    const d = el("details", "thinking");
    d.append(el("summary", null, "Thinking"), el("div", "text", m.reasoning));
    div.append(d);
  }
  div.append(el("div", "text content", m.text || ""));
  for (const t of m.tools || []) {
    const box = el("div", "tool-call");
    box.append(el("div", "tool-name", "Tool call: " + ((t.function && t.function.name) || "?") + (t.id ? `  (${t.id})` : "")));
    let args = (t.function && t.function.arguments) || "";
    try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (_) { /* still streaming, or not JSON */ }
    box.append(el("pre", "tool-args", args));
    div.append(box);
  }
  if (m.error) div.append(el("div", "error", m.error));
  if (m.finish && m.finish !== "stop") div.append(el("div", "finish muted", finishNote(m.finish)));
  return div;
}

function finishNote(f) {
  return { length: "(cut at max tokens)", stopped: "(stopped)", tool_calls: "(tool calls)" }[f] || `(${f})`;
}

function updateMessage(i) {
  const box = $("messages");
  const old = box.querySelector(`.msg[data-index="${i}"]`);
  const fresh = renderMessage(ui.messages[i], i);
  if (old) {
    const open = old.querySelector("details.thinking");
    const d = fresh.querySelector("details.thinking");
    if (open && d) d.open = open.open;
    old.replaceWith(fresh);
  } else {
    box.append(fresh);
  }
  box.scrollTop = box.scrollHeight;
}

// -- sending -----------------------------------------------------------------------------
function apiMessages() {
  const out = [];
  const system = $("system").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of ui.messages) {
    if (m.role === "assistant") {
      const a = { role: "assistant", content: m.text || "" };
      if (m.tools && m.tools.length) a.tool_calls = m.tools;
      out.push(a);
      continue;
    }
    const media = (m.media || []).filter((x) => x.url);
    if (!media.length) {
      out.push({ role: "user", content: m.text });
      continue;
    }
    const parts = media.map((x) => x.kind === "image"
      ? { type: "image_url", image_url: { url: x.url } }
      : { type: "input_audio", input_audio: { data: x.url.slice(x.url.indexOf(",") + 1), format: x.format } });
    if (m.text) parts.push({ type: "text", text: m.text });
    out.push({ role: "user", content: parts });
  }
  return out;
}

function numberSetting(id, parse) {
  const v = $(id).value.trim();
  if (v === "") return undefined;
  const n = parse(v);
  if (!Number.isFinite(n)) throw new Error(`${id} must be a number`);
  return n;
}

function requestBody() {
  const body = {
    model: ui.caps.model,
    messages: apiMessages(),
    stream: true,
    stream_options: { include_usage: true },
  };
  const t = numberSetting("temperature", parseFloat);
  const p = numberSetting("top_p", parseFloat);
  const mt = numberSetting("max_tokens", (v) => parseInt(v, 10));
  if (t !== undefined) body.temperature = t;
  if (p !== undefined) body.top_p = p;
  const cap = (ui.caps.limits || {}).max_tokens;  // the server's own limit: never ask for more
  if (mt !== undefined) body.max_tokens = cap ? Math.min(mt, cap) : mt;
  if (ui.caps.thinking && $("think").checked) body.reasoning_effort = "medium";
  const tools = ui.caps.tools ? $("tools").value.trim() : "";
  if (tools) {
    let decls;
    try { decls = JSON.parse(tools); } catch (e) { throw new Error("the tools are not valid JSON: " + e.message); }
    if (!Array.isArray(decls)) throw new Error("the tools must be a JSON list of {\"type\": \"function\", ...}");
    body.tools = decls;
    body.tool_choice = $("tool_choice").value;
  }
  return body;
}

async function send(ev) {
  if (ev) ev.preventDefault();
  if (ui.controller || !ui.caps) return;
  const text = $("input").value;
  if (!text.trim() && !ui.pending.length) return;
  ui.messages.push({ role: "user", text, media: ui.pending });
  ui.pending = [];
  $("input").value = "";
  renderAttachments();
  await reply();
}

async function regenerate() {
  if (ui.controller) return;
  while (ui.messages.length && ui.messages[ui.messages.length - 1].role === "assistant") ui.messages.pop();
  if (!ui.messages.length) return;
  await reply();
}

function stop() {
  if (ui.controller) ui.controller.abort();
}

async function reply() {
  let body;
  try {
    body = requestBody();
  } catch (e) {
    setStatus(e.message, true);
    return;
  }
  const m = { role: "assistant", text: "", reasoning: "", tools: [], finish: null, error: null };
  ui.messages.push(m);
  const i = ui.messages.length - 1;
  ui.controller = new AbortController();
  setBusy(true);
  renderAll();
  const node = () => $("messages").querySelector(`.msg[data-index="${i}"]`);
  let chunks = 0;
  try {
    const r = await api("/v1/chat/completions", body, ui.controller.signal);
    await readEvents(r, (data) => {
      if (data.error) {
        m.error = data.error.message || "error";
        return;
      }
      for (const c of data.choices || []) {
        const d = c.delta || {};
        if (typeof d.content === "string") m.text += d.content;
        if (typeof d.reasoning_content === "string") m.reasoning += d.reasoning_content;
        for (const tc of d.tool_calls || []) mergeToolCall(m.tools, tc);
        if (c.finish_reason) m.finish = c.finish_reason;
      }
      if (hasDelta(data)) chunks += 1;
      if (ui.messages[i] !== m) return;
      updateMessage(i);
      const n = node();
      if (n) n.dataset.chunks = String(chunks);
    });
  } catch (e) {
    if (e.name === "AbortError") m.finish = "stopped";
    else if (e instanceof KeyNeeded) m.error = "an API key is needed: enter it, then regenerate";
    else m.error = e.message;
  } finally {
    ui.controller = null;
    setBusy(false);
    if (ui.messages[i] === m) {  // (not cleared meanwhile)
      saveChat();
      renderAll();
      const n = node();
      if (n) {
        n.dataset.chunks = String(chunks);
        n.dataset.done = "1";
      }
    }
  }
}

function hasDelta(data) {
  return (data.choices || []).some((c) => c.delta && (c.delta.content || c.delta.reasoning_content || c.delta.tool_calls));
}

function mergeToolCall(calls, tc) {
  const k = typeof tc.index === "number" ? tc.index : calls.length;
  const cur = calls[k] || (calls[k] = { id: "", type: "function", function: { name: "", arguments: "" } });
  if (tc.id) cur.id = tc.id;
  if (tc.type) cur.type = tc.type;
  if (tc.function) {
    if (tc.function.name) cur.function.name += tc.function.name;
    if (tc.function.arguments) cur.function.arguments += tc.function.arguments;
  }
}

async function readEvents(response, onData) {
  // Server-sent events: "data: JSON" lines, blank-line separated, ending with "data: [DONE]".
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const payload = line.slice(5).trim();
        if (payload === "[DONE]") return;
        onData(JSON.parse(payload));
      }
    }
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("regenerate").disabled = busy;
  document.body.dataset.busy = busy ? "1" : "";
}

function clearChat() {
  stop();
  ui.messages = [];
  localStorage.removeItem(STORE.chat);
  renderAll();
}

// -- attachments ---------------------------------------------------------------------------
function readDataURL(file) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result);
    r.onerror = () => reject(r.error);
    r.readAsDataURL(file);
  });
}

const AUDIO_FORMATS = { "audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav", "audio/mpeg": "mp3",
  "audio/mp3": "mp3", "audio/flac": "flac", "audio/x-flac": "flac", "audio/ogg": "ogg", "audio/webm": "webm" };

function audioFormat(file) {
  const f = AUDIO_FORMATS[file.type];
  if (f) return f;
  const dot = file.name.lastIndexOf(".");
  return dot >= 0 ? file.name.slice(dot + 1).toLowerCase() : "wav";
}

async function addFiles(files) {
  for (const file of files) {
    const isImage = file.type.startsWith("image/");
    const isAudio = file.type.startsWith("audio/");
    if (isImage && !ui.caps.vision || isAudio && !ui.caps.audio || !isImage && !isAudio) {
      setStatus(`${file.name || "this file"}: the model does not take ${isImage ? "pictures" : isAudio ? "audio" : "this kind of file"}`, true);
      continue;
    }
    const lim = ui.caps.limits || {};
    if (isImage && lim.max_image_bytes && file.size > lim.max_image_bytes) {
      setStatus(`${file.name}: larger than the ${lim.max_image_bytes} bytes the server takes`, true);
      continue;
    }
    const url = await readDataURL(file);
    ui.pending.push(isImage ? { kind: "image", url, name: file.name } : { kind: "audio", url, name: file.name, format: audioFormat(file) });
  }
  renderAttachments();
}

function renderAttachments() {
  renderChips($("attachments"), ui.pending, renderAttachments);
}

function renderChips(box, items, rerender) {
  // one chip per attachment (a thumbnail for pictures) with a button that removes it from items
  box.replaceChildren();
  items.forEach((x, k) => {
    const chip = el("span", "chip " + x.kind);
    if (x.kind === "image") {
      const img = el("img");
      img.src = x.url;
      img.alt = x.name || "picture";
      chip.append(img);
    }
    chip.append(el("span", null, x.name || x.kind));
    const rm = el("button", "chip-x", "×");
    rm.type = "button";
    rm.title = "remove";
    rm.addEventListener("click", () => { items.splice(k, 1); rerender(); });
    chip.append(rm);
    box.append(chip);
  });
}

// -- recording from the microphone, encoded to 16 kHz mono WAV in the page -------------------
const WAV_RATE = 16000;

function encodeWav(samples, rate) {
  // 16-bit PCM, mono: samples are floats in [-1, 1] (clipped), rounded to the nearest integer
  const n = samples.length;
  const buf = new ArrayBuffer(44 + 2 * n);
  const v = new DataView(buf);
  const str = (o, s) => { for (let k = 0; k < s.length; k++) v.setUint8(o + k, s.charCodeAt(k)); };
  str(0, "RIFF"); v.setUint32(4, 36 + 2 * n, true); str(8, "WAVE");
  str(12, "fmt "); v.setUint32(16, 16, true); v.setUint16(20, 1, true); v.setUint16(22, 1, true);
  v.setUint32(24, rate, true); v.setUint32(28, 2 * rate, true); v.setUint16(32, 2, true); v.setUint16(34, 16, true);
  str(36, "data"); v.setUint32(40, 2 * n, true);
  for (let k = 0; k < n; k++) {
    const x = Math.max(-1, Math.min(1, samples[k]));
    v.setInt16(44 + 2 * k, Math.round(x < 0 ? x * 32768 : x * 32767), true);
  }
  return new Uint8Array(buf);
}

function bytesToBase64(bytes) {
  let s = "";
  for (let k = 0; k < bytes.length; k += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(k, k + 0x8000));
  return btoa(s);
}

async function toMono16k(blob) {
  const data = await blob.arrayBuffer();
  const ctx = new AudioContext();
  let decoded;
  try { decoded = await ctx.decodeAudioData(data); } finally { ctx.close(); }
  const frames = Math.max(1, Math.ceil(decoded.duration * WAV_RATE));
  const off = new OfflineAudioContext(1, frames, WAV_RATE);  // downmixes and resamples
  const src = off.createBufferSource();
  src.buffer = decoded;
  src.connect(off.destination);
  src.start();
  return (await off.startRendering()).getChannelData(0);
}

let recorder = null;

async function toggleRecording() {
  if (recorder) {
    recorder.stop();
    return;
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (e) {
    setStatus("no microphone: " + e.message, true);
    return;
  }
  const parts = [];
  recorder = new MediaRecorder(stream);
  recorder.ondataavailable = (e) => parts.push(e.data);
  recorder.onstop = async () => {
    stream.getTracks().forEach((t) => t.stop());
    recorder = null;
    $("record").textContent = "Record";
    try {
      const wav = encodeWav(await toMono16k(new Blob(parts)), WAV_RATE);
      const name = "recording.wav";
      ui.pending.push({ kind: "audio", url: "data:audio/wav;base64," + bytesToBase64(wav), name, format: "wav" });
      renderAttachments();
    } catch (e) {
      setStatus("could not read the recording: " + e.message, true);
    }
  };
  recorder.start();
  $("record").textContent = "Stop recording";
}

// -- embeddings tab --------------------------------------------------------------------------
// Inputs go to /v1/embeddings as the server takes them: a text as a string, a picture as one
// input of content parts ([{type: "image_url", ...}]), a query of both as [picture, text].
function embedInput(x) {
  if (typeof x === "string") return x;
  const parts = [{ type: "image_url", image_url: { url: x.image.url } }];
  if (x.text) parts.push({ type: "text", text: x.text });
  return parts;
}

async function embed(inputs) {
  // in requests of at most max_inputs inputs and max_images pictures (the server's limits)
  const lim = ui.caps.limits || {};
  const perInputs = lim.max_inputs || 64, perImages = lim.max_images || 8;
  const out = [];
  let batch = [], pics = 0;
  const flush = async () => {
    if (!batch.length) return;
    const r = await api("/v1/embeddings", { model: ui.caps.embedder, input: batch.map(embedInput) });
    const j = await r.json();
    for (const d of j.data.sort((a, b) => a.index - b.index)) out.push(d.embedding);
    batch = [];
    pics = 0;
  };
  for (const x of inputs) {
    const p = typeof x === "string" ? 0 : 1;
    if (batch.length + 1 > perInputs || pics + p > perImages) await flush();
    batch.push(x);
    pics += p;
  }
  await flush();
  return out;
}

function cosine(a, b) {
  let ab = 0, aa = 0, bb = 0;
  for (let k = 0; k < a.length; k++) { ab += a[k] * b[k]; aa += a[k] * a[k]; bb += b[k] * b[k]; }
  return ab / Math.sqrt(aa * bb);
}

async function embedPictures(files, into) {
  // pictures the embeddings tab takes (checked as the chat's are); into: "docs" or "query"
  if (!ui.caps || !ui.caps.embedding_images) {
    setStatus("the embedder does not take pictures", true);
    return;
  }
  const lim = ui.caps.limits || {};
  for (const file of files) {
    if (!file.type.startsWith("image/")) {
      setStatus(`${file.name || "this file"}: not a picture`, true);
      continue;
    }
    if (lim.max_image_bytes && file.size > lim.max_image_bytes) {
      setStatus(`${file.name}: larger than the ${lim.max_image_bytes} bytes the server takes`, true);
      continue;
    }
    const pic = { kind: "image", url: await readDataURL(file), name: file.name || "picture" };
    if (into === "query") ui.embed.query = pic;
    else ui.embed.images.push(pic);
  }
  renderEmbedPictures();
}

function renderEmbedPictures() {
  renderChips($("embed-attachments"), ui.embed.images, renderEmbedPictures);
  const q = ui.embed.query ? [ui.embed.query] : [];
  renderChips($("embed-query-attachment"), q, () => { ui.embed.query = q[0] || null; renderEmbedPictures(); });
}

async function rank() {
  const texts = $("embed-docs").value.split("\n").map((s) => s.trim()).filter((s) => s);
  const docs = texts.concat(ui.embed.images.map((image) => ({ image })));
  const text = $("embed-query").value.trim();
  const query = ui.embed.query ? { image: ui.embed.query, text } : text;
  const list = $("embed-results");
  list.replaceChildren();
  if (!docs.length || !query) {
    setStatus("give some texts or pictures, and a query", true);
    return;
  }
  setStatus("embedding…");
  try {
    const [q, ...vecs] = await embed([query, ...docs]);
    const ranked = docs.map((doc, k) => ({ doc, score: cosine(q, vecs[k]) })).sort((a, b) => b.score - a.score);
    for (const r of ranked) {
      const li = el("li", "ranked");
      li.dataset.score = String(r.score);
      li.append(el("span", "score", r.score.toFixed(4)));
      if (typeof r.doc === "string") {
        li.append(el("span", "doc", r.doc));
      } else {
        li.dataset.kind = "image";
        const img = el("img");
        img.src = r.doc.image.url;
        img.alt = r.doc.image.name;
        li.append(img, el("span", "doc", r.doc.image.name));
      }
      list.append(li);
    }
    setStatus("");
  } catch (e) {
    if (!(e instanceof KeyNeeded)) setStatus(e.message, true);
  }
}

function showTab(name) {
  for (const b of document.querySelectorAll(".tab")) b.classList.toggle("active", b.dataset.tab === name);
  $("chat-view").hidden = name !== "chat";
  $("embed-view").hidden = name !== "embed";
  $("settings").hidden = name !== "chat";
}

// -- wiring -----------------------------------------------------------------------------------
function wire() {
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
  });
  $("stop").addEventListener("click", stop);
  $("regenerate").addEventListener("click", regenerate);
  $("clear").addEventListener("click", clearChat);
  $("image-input").addEventListener("change", (e) => { addFiles([...e.target.files]); e.target.value = ""; });
  $("audio-input").addEventListener("change", (e) => { addFiles([...e.target.files]); e.target.value = ""; });
  $("record").addEventListener("click", toggleRecording);
  for (const k of SETTINGS) $(k).addEventListener("change", saveSettings);
  $("think").addEventListener("change", saveSettings);
  for (const b of document.querySelectorAll(".tab")) b.addEventListener("click", () => showTab(b.dataset.tab));
  $("embed-rank").addEventListener("click", rank);
  $("embed-image-input").addEventListener("change", (e) => { embedPictures([...e.target.files], "docs"); e.target.value = ""; });
  $("embed-query-input").addEventListener("change", (e) => { embedPictures([...e.target.files], "query"); e.target.value = ""; });
  $("forget-key").addEventListener("click", () => {
    localStorage.removeItem(STORE.key);
    ui.key = "";
    $("forget-key").hidden = true;
  });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    ui.key = $("key-input").value.trim();
    localStorage.setItem(STORE.key, ui.key);
    $("key-dialog").close();
    start();
  });
  // pictures and audio: pasted, or dropped anywhere on the chat
  document.addEventListener("paste", (e) => {
    const files = [...((e.clipboardData && e.clipboardData.files) || [])];
    if (files.length && ui.caps) {
      e.preventDefault();
      if (!$("embed-view").hidden) embedPictures(files, e.target === $("embed-query") ? "query" : "docs");
      else addFiles(files);
    }
  });
  dropZone($("chat-view"), (files) => addFiles(files));
  // the embeddings tab: pictures dropped on the query are the query's, elsewhere documents
  dropZone($("embed-view"), (files, e) => embedPictures(files, e.target === $("embed-query") ? "query" : "docs"));
}

// a view that takes dropped files: highlighted while dragged over, the files to `take` once loaded
function dropZone(view, take) {
  view.addEventListener("dragover", (e) => { e.preventDefault(); view.classList.add("drop"); });
  view.addEventListener("dragleave", () => view.classList.remove("drop"));
  view.addEventListener("drop", (e) => {
    e.preventDefault();
    view.classList.remove("drop");
    const files = [...((e.dataTransfer && e.dataTransfer.files) || [])];
    if (files.length && ui.caps) take(files, e);
  });
}

window.gemmaliteUI = { encodeWav };  // for tests and the console: the page's WAV encoder

document.addEventListener("DOMContentLoaded", () => {
  wire();
  loadSettings();
  loadChat();
  renderAll();
  start();
});
