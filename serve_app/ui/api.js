// The console's only way to the API: fetch with the key from sessionStorage as an Authorization header (never a
// URL), structured errors as ApiError, and live job events read from a fetch stream (EventSource cannot send
// headers, so it would need the key in the URL).
const KEY = "alloy.apiKey";

export class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(`${error.code || "HTTP_" + status}: ${error.message || "request failed"}`);
    this.status = status;
    this.code = error.code;
    this.details = error.details || {};
  }
}

export const key = {
  get: () => sessionStorage.getItem(KEY),
  set: (value) => sessionStorage.setItem(KEY, value.trim()),
  clear: () => sessionStorage.removeItem(KEY),
};

function headers(extra = {}) {
  const value = key.get();
  return value ? { Authorization: `Bearer ${value}`, ...extra } : extra;
}

export async function api(path, { method = "GET", body } = {}) {
  const response = await fetch(path, {
    method,
    headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (response.status === 204) return null;
  const data = await response.json().catch(() => null);
  if (!response.ok) throw new ApiError(response.status, data);
  return data;
}

// Follow GET /jobs/{id}/events (Server-Sent Events) until the end event; onEvent({event, id, data}).
// Reconnects with Last-Event-ID when the connection drops. Returns a function that stops following.
export function followJob(jobId, onEvent) {
  let stopped = false;
  let lastId = null;
  const controller = new AbortController();
  (async () => {
    while (!stopped) {
      try {
        const extra = { Accept: "text/event-stream" };
        if (lastId) extra["Last-Event-ID"] = lastId;
        const response = await fetch(`/jobs/${encodeURIComponent(jobId)}/events`,
                                     { headers: headers(extra), signal: controller.signal });
        if (!response.ok) throw new ApiError(response.status, await response.json().catch(() => null));
        const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value.replace(/\r\n/g, "\n");
          let cut;
          while ((cut = buffer.indexOf("\n\n")) >= 0) {
            const message = parse(buffer.slice(0, cut));
            buffer = buffer.slice(cut + 2);
            if (!message) continue;
            lastId = message.id || lastId;
            onEvent(message);
            if (message.event === "end") { stopped = true; return; }
          }
        }
      } catch (error) {
        if (stopped || error.name === "AbortError") return;
        if (error instanceof ApiError) { onEvent({ event: "error", data: { message: error.message } }); return; }
      }
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
  })();
  return () => { stopped = true; controller.abort(); };
}

function parse(block) {
  const message = { event: "message", id: null, data: "" };
  let any = false;
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue;  // keep-alive comment
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "data") { message.data += (message.data ? "\n" : "") + value; any = true; }
    else if (field === "event") message.event = value;
    else if (field === "id") message.id = value;
  }
  if (!any) return null;
  try { message.data = JSON.parse(message.data); } catch { /* plain text */ }
  return message;
}
