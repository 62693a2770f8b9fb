// edgellm's chat page: the server's own OpenAI routes from the browser, nothing fetched from anywhere
// else. The conversation, the system prompt, the model and the key stay in this browser (localStorage).
"use strict";

const $ = (id) => document.getElementById(id);
const saved = (name, fallback) => JSON.parse(localStorage.getItem("edgellm." + name) ?? JSON.stringify(fallback));
const keep = (name, value) => localStorage.setItem("edgellm." + name, JSON.stringify(value));

let messages = saved("messages", []);
let running = null; // the AbortController of the answer being streamed

function headers() {
  const key = $("key").value.trim();
  return Object.assign({ "Content-Type": "application/json" }, key ? { Authorization: "Bearer " + key } : {});
}

// -- markdown, as much as answers use: code blocks, inline code, bold, italics, lists, paragraphs --
function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

function inline(text) {
  return escapeHtml(text)
    .replace(/`([^`]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>");
}

function markdown(text) {
  const out = [];
  const parts = text.split(/```/);
  parts.forEach((part, i) => {
    if (i % 2 === 1) { // a code block (its first line may name the language)
      const body = part.replace(/^[\w+-]*\n/, "");
      out.push("<pre><code>" + escapeHtml(body) + "</code></pre>");
      return;
    }
    let list = null;
    for (const line of part.split("\n")) {
      const item = line.match(/^\s*(?:[-*]|\d+\.)\s+(.*)$/);
      if (item) {
        if (!list) { list = []; }
        list.push("<li>" + inline(item[1]) + "</li>");
        continue;
      }
      if (list) { out.push("<ul>" + list.join("") + "</ul>"); list = null; }
      if (line.trim()) { out.push("<p>" + inline(line) + "</p>"); }
    }
    if (list) { out.push("<ul>" + list.join("") + "</ul>"); }
  });
  return out.join("");
}

// -- the conversation on the page --
function show(message) {
  const div = document.createElement("div");
  div.className = "message " + message.role;
  div.innerHTML = message.role === "assistant" ? markdown(message.content) : "<p>" + inline(message.content) + "</p>";
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

function redraw() {
  $("log").innerHTML = "";
  messages.forEach(show);
}

async function loadModels() {
  const select = $("model");
  try {
    const answer = await fetch("/v1/models", { headers: headers() });
    const body = await answer.json();
    if (!answer.ok) { throw new Error(body.error ? body.error.message : answer.statusText); }
    select.innerHTML = "";
    for (const model of body.data) {
      const option = document.createElement("option");
      option.value = option.textContent = model.id;
      select.appendChild(option);
    }
    const wanted = saved("model", null);
    if (wanted && [...select.options].some((o) => o.value === wanted)) { select.value = wanted; }
  } catch (error) {
    $("speed").textContent = "models: " + error.message;
  }
}

// -- asking: a streamed chat completion, read chunk by chunk --
async function ask(text) {
  const system = $("system").value.trim();
  messages.push({ role: "user", content: text });
  keep("messages", messages);
  show(messages[messages.length - 1]);
  const answer = { role: "assistant", content: "" };
  const bubble = show(answer);
  const body = {
    model: $("model").value, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    messages: (system ? [{ role: "system", content: system }] : []).concat(messages),
  };
  if ($("json").checked) { body.response_format = { type: "json_object" }; }
  running = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  const started = performance.now();
  let report = null;
  try {
    const reply = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: running.signal });
    if (!reply.ok) {
      const problem = await reply.json().catch(() => ({}));
      throw new Error(problem.error ? problem.error.message : reply.statusText);
    }
    const reader = reply.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) { break; }
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.replace(/^data: /, "");
        if (data === "[DONE]") { continue; }
        const chunk = JSON.parse(data);
        if (chunk.error) { throw new Error(chunk.error.message); }
        if (chunk.edgellm && chunk.usage) { report = chunk.edgellm; }
        for (const choice of chunk.choices || []) {
          if (choice.delta && choice.delta.content) {
            answer.content += choice.delta.content;
            bubble.innerHTML = markdown(answer.content);
            $("log").scrollTop = $("log").scrollHeight;
          }
        }
      }
    }
  } catch (error) {
    if (error.name !== "AbortError") {
      bubble.className = "message error";
      bubble.textContent = error.message;
    }
  } finally {
    running = null;
    $("send").disabled = false; $("stop").disabled = true;
  }
  if (answer.content) {
    messages.push(answer);
    keep("messages", messages);
  }
  $("speed").textContent = report
    ? `TTFT ${(report.ttft_s * 1000).toFixed(0)} ms · ${report.decode_tokens_per_s.toFixed(1)} tok/s · `
      + `${report.completion_tokens} tokens`
    : `stopped after ${((performance.now() - started) / 1000).toFixed(1)} s`;
}

// -- wiring --
$("key").value = saved("key", "");
$("system").value = saved("system", "");
$("temperature").value = saved("temperature", 0.7);
$("temperature").addEventListener("change", () => keep("temperature", Number($("temperature").value)));
$("key").addEventListener("change", () => { keep("key", $("key").value); loadModels(); });
$("system").addEventListener("change", () => keep("system", $("system").value));
$("model").addEventListener("change", () => keep("model", $("model").value));
$("clear").addEventListener("click", () => { messages = []; keep("messages", messages); redraw(); $("speed").textContent = ""; });
$("stop").addEventListener("click", () => running && running.abort());
$("ask").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || running) { return; }
  $("prompt").value = "";
  ask(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("ask").requestSubmit(); }
});
redraw();
loadModels();
