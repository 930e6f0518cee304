// pagedserve dashboard: polls GET /v1/stats and draws with plain SVG. No dependencies, no build step.
// The API key (when the server asks for one) lives in this closure only: never in storage or the URL.
"use strict";
(() => {
  const POLL_MS = 1000;
  const SVG = "http://www.w3.org/2000/svg";
  const MAP_CELLS = 400;
  let apiKey = null;
  let timer = null;

  const $ = (sel) => document.querySelector(sel);
  const fmt = (v, digits = 1) => {
    if (v === null || v === undefined || Number.isNaN(v)) return "n/a";
    if (Math.abs(v) >= 1e9) return (v / 1e9).toFixed(digits) + "G";
    if (Math.abs(v) >= 1e6) return (v / 1e6).toFixed(digits) + "M";
    if (Math.abs(v) >= 1e4) return (v / 1e3).toFixed(digits) + "k";
    return Number.isInteger(v) ? String(v) : v.toFixed(digits);
  };
  const count = (v) => (v === null || v === undefined ? "n/a" : String(Math.round(v)));
  const ms = (s) => (s === null || s === undefined ? "n/a" : (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms");
  const pct = (v) => (v === null || v === undefined ? "n/a" : (v * 100).toFixed(1) + "%");
  const duration = (s) => {
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = Math.floor(s % 60);
    return (h ? h + "h " : "") + (h || m ? m + "m " : "") + sec + "s";
  };

  function setStat(name, text) {
    for (const el of document.querySelectorAll(`[data-stat="${name}"]`)) el.textContent = text;
  }

  function el(tag, attrs = {}, text) {
    const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // --- data -----------------------------------------------------------------------------------------
  async function poll() {
    const headers = apiKey ? { Authorization: "Bearer " + apiKey } : {};
    let response;
    try {
      response = await fetch("/v1/stats", { headers, cache: "no-store" });
    } catch (err) {
      status("unreachable", "down");
      return schedule();
    }
    if (response.status === 401) {
      askForKey(apiKey ? "That key was refused." : "");
      return;
    }
    if (!response.ok) {
      status("HTTP " + response.status, "down");
      return schedule();
    }
    const stats = await response.json();
    status("live", "up");
    render(stats);
    schedule();
  }

  function schedule() {
    clearTimeout(timer);
    timer = setTimeout(poll, POLL_MS);
  }

  function status(text, cls) {
    const s = $("#status");
    s.textContent = text;
    s.className = "status " + cls;
  }

  function askForKey(message) {
    status("API key needed", "down");
    $("#key-form").hidden = false;
    $("#key-error").textContent = message;
    $("#key-input").focus();
  }

  // --- render ---------------------------------------------------------------------------------------
  function render(s) {
    renderServer(s.server, s.now.lora, s.now.speculative);
    const t = s.totals, n = s.now, series = s.series;
    const last = (arr) => (arr && arr.length ? arr[arr.length - 1] : 0);
    setStat("running", count(n.running));
    setStat("waiting", count(n.waiting));
    setStat("prompt_tok_s", fmt(last(series.prompt_tok_s)));
    setStat("generation_tok_s", fmt(last(series.generation_tok_s)));
    setStat("requests", count(t.requests));
    setStat("errors", count(t.errors));
    setStat("rejected", count(t.rejected));
    setStat("preemptions", count(t.preemptions));
    setStat("hit_rate", pct(t.prefix_cache_hit_rate));
    setStat("prompt_tokens", count(t.prompt_tokens));
    setStat("generation_tokens", count(t.generation_tokens));
    for (const [reason, value] of Object.entries(t.finished)) setStat("finished_" + reason, count(value));
    renderEfficiency(s.efficiency);
    lineChart($("#chart-throughput"), series.seconds_ago,
      [["prompt", series.prompt_tok_s], ["gen", series.generation_tok_s]]);
    lineChart($("#chart-requests"), series.seconds_ago, [["running", series.running], ["waiting", series.waiting]]);
    lineChart($("#chart-kv"), series.seconds_ago, [["used", series.kv_used], ["cached", series.kv_cached]],
      n.kv_blocks.total);
    renderLatency(s.latency, s.server.latency_window_s);
    renderBlockMap(n.kv_blocks);
    renderRequests(s.requests);
  }

  function renderServer(info, lora, spec) {
    const facts = [["model", info.served_model_name + (info.model !== info.served_model_name ? " (" + info.model + ")" : "")],
      ["device", info.device + (info.device_name ? " · " + info.device_name : "")], ["dtype", info.dtype],
      ["weights", (info.weight_format || info.dtype) + " · " + (info.model_weight_bytes / 1e6).toFixed(1) + " MB"],
      ["attention", info.attention_backend], ["CUDA graphs", info.cuda_graphs ? "on" : "off"],
      ["version", info.version], ["uptime", duration(info.uptime_s)]];
    if (lora) {   // --enable-lora: the adapters with running requests, and those waiting for a slot
      facts.push(["LoRA", "running: " + (lora.running.join(", ") || "none") + " · waiting: " +
        (lora.waiting.join(", ") || "none") + " · slots: " + lora.max_loras]);
    }
    if (spec) {   // --speculative-config: how many drafts are accepted, and tokens per verifying step
      facts.push(["speculative", spec.method + " · k " + spec.num_speculative_tokens + " · acceptance " +
        pct(spec.acceptance_rate) + " · " + (spec.mean_accepted_length === null ? "-" :
        spec.mean_accepted_length.toFixed(2)) + " tokens/step"]);
    }
    const dl = $("#server");
    dl.replaceChildren();
    for (const [k, v] of facts) {
      dl.append(el("dt", {}, k), el("dd", { "data-fact": k }, v));
    }
  }

  function renderEfficiency(e) {
    if (e.utilization !== null && e.utilization !== undefined) {
      setStat("efficiency", pct(e.utilization));
      setStat("efficiency_detail", fmt(e.decode_bytes_per_s) + "B/s of " + fmt(e.memory_bandwidth) + "B/s");
    } else {
      setStat("efficiency", "n/a");
      const why = e.memory_bandwidth ? "" : " (device bandwidth unknown)";
      setStat("efficiency_detail", e.decode_bytes_per_s !== null ? fmt(e.decode_bytes_per_s) + "B/s decode" + why
        : "no decode step in the last " + e.window_s + " s" + why);
    }
  }

  function lineChart(svg, xs, lines, fixedMax) {
    const W = 600, H = 180, PAD_L = 44, PAD_B = 18, PAD_T = 8;
    svg.replaceChildren();
    const span = Math.max(60, xs.length ? -xs[0] : 60);
    let max = fixedMax || 0;
    if (!fixedMax) for (const [, values] of lines) for (const v of values) max = Math.max(max, v);
    max = max > 0 ? max * (fixedMax ? 1 : 1.1) : 1;
    const x = (t) => PAD_L + (W - PAD_L - 4) * (1 + t / span);
    const y = (v) => H - PAD_B - (H - PAD_B - PAD_T) * (v / max);
    for (const frac of [0, 0.5, 1]) {
      svg.append(el("svg:line", { x1: PAD_L, x2: W - 4, y1: y(max * frac), y2: y(max * frac), class: "grid" }));
      svg.append(el("svg:text", { x: PAD_L - 4, y: y(max * frac) + 4, class: "axis", "text-anchor": "end" },
        fmt(max * frac, max * frac < 10 ? 1 : 0)));
    }
    for (const t of [-span, -span / 2, 0]) {
      svg.append(el("svg:text", { x: x(t), y: H - 4, class: "axis", "text-anchor": t === 0 ? "end" : "start" },
        t === 0 ? "now" : Math.round(t) + " s"));
    }
    for (const [cls, values] of lines) {
      if (!values.length) continue;
      const points = values.map((v, i) => x(xs[i]).toFixed(1) + "," + y(v).toFixed(1)).join(" ");
      svg.append(el("svg:polyline", { points, class: "line " + cls }));
    }
  }

  function renderLatency(latency, windowS) {
    $("#latency-window").textContent = "(last " + windowS + " s and since start)";
    const body = $("#latency tbody");
    body.replaceChildren();
    for (const [name, label] of [["ttft", "time to first token"], ["itl", "inter-token latency"]]) {
      for (const [scope, scopeLabel] of [["window", "last " + windowS + " s"], ["all", "since start"]]) {
        const q = latency[name][scope];
        const row = el("tr", { "data-latency": name + "-" + scope });
        row.append(el("th", {}, label + ", " + scopeLabel));
        for (const key of ["p50", "p90", "p99"]) row.append(el("td", { "data-q": key }, q ? ms(q[key]) : "n/a"));
        row.append(el("td", { "data-q": "count" }, q ? count(q.count) : "0"));
        body.append(row);
      }
    }
  }

  function renderBlockMap(kv) {
    // Cells in proportion to the block counts (the engine reports counts per state, not positions).
    const map = $("#kv-map");
    const cells = Math.min(MAP_CELLS, kv.total);
    const perCell = kv.total / cells;
    const used = Math.round(kv.used / perCell), cached = Math.round(kv.cached / perCell);
    if (map.childElementCount !== cells) {
      map.replaceChildren(...Array.from({ length: cells }, () => el("span")));
    }
    Array.from(map.children).forEach((cell, i) => {
      cell.className = i < used ? "used" : i < used + cached ? "cached" : "free";
    });
    $("#kv-caption").textContent = "(" + kv.total + " blocks" + (perCell > 1 ? ", one cell ≈ " + perCell.toFixed(1) : "") + ")";
    setStat("kv_used", count(kv.used));
    setStat("kv_cached", count(kv.cached));
    setStat("kv_free", count(kv.free));
  }

  function renderRequests(requests) {
    const box = $("#requests");
    box.replaceChildren();
    if (!requests.length) {
      box.append(el("p", { class: "empty" }, "No requests yet."));
      return;
    }
    const span = Math.max(...requests.map((r) => (r.finished_s !== null ? r.finished_s : r.age_s)), 0.001);
    for (const r of requests) box.append(requestRow(r, span));
  }

  function requestRow(r, span) {
    const W = 400, H = 14;
    const row = el("div", { class: "req", "data-request": r.id });
    const reason = r.state === "finished" ? r.finish_reason || "finished" : r.state;
    row.append(el("span", { class: "rid", title: r.id }, r.id));
    row.append(el("span", { class: "state " + r.state }, reason));
    const svg = el("svg:svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", class: "timeline" });
    const x = (t) => (W * t) / span;
    const end = r.finished_s !== null ? r.finished_s : r.age_s;
    const queuedEnd = r.queued_s !== null ? r.queued_s : end;
    const prefillEnd = r.first_token_s !== null ? r.first_token_s : end;
    const seg = (a, b, cls) => {
      if (b > a) svg.append(el("svg:rect", { x: x(a), y: 2, width: Math.max(1, x(b) - x(a)), height: H - 4, class: cls }));
    };
    seg(0, queuedEnd, "queued");
    if (r.queued_s !== null) seg(r.queued_s, prefillEnd, "prefill");
    if (r.first_token_s !== null) seg(r.first_token_s, end, "decode");
    for (const [t] of r.prefill_chunks) svg.append(el("svg:line", { x1: x(t), x2: x(t), y1: 0, y2: H, class: "chunk" }));
    for (const t of r.preempted_s) svg.append(el("svg:line", { x1: x(t), x2: x(t), y1: 0, y2: H, class: "preempt" }));
    row.append(svg);
    const chunks = r.prefill_chunks.map((c) => c[1]).join("+") || "0";
    row.append(el("span", { class: "tokens" }, `prompt ${r.prompt_tokens} (cached ${r.cached_tokens}, chunks ${chunks})` +
      ` · out ${r.output_tokens}` + (r.preempted_s.length ? ` · preempted ×${r.preempted_s.length}` : "") +
      ` · ${ms(end)}`));
    if (r.prompt !== undefined) {
      const text = el("div", { class: "text" });
      text.append(el("span", { class: "prompt" }, r.prompt), el("span", { class: "output" }, r.output));
      row.append(text);
    }
    return row;
  }

  // --- start ----------------------------------------------------------------------------------------
  document.addEventListener("DOMContentLoaded", () => {
    $("#key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      apiKey = $("#key-input").value;
      $("#key-input").value = "";
      $("#key-form").hidden = true;
      poll();
    });
    const auth = document.querySelector('meta[name="pagedserve-api-key"]');
    if (auth && auth.content === "required") askForKey("");
    else poll();
  });
})();
