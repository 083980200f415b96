// servelm dashboard: polls dashboard/data and draws with plain canvas and SVG (no libraries).
// The API key, when the server has one, comes from the URL fragment (#key=..., which a
// browser never sends) or the form, and is kept in sessionStorage for this tab only.
(function () {
  "use strict";
  const HISTORY = 300;  // polls kept for the time-series charts
  const COLORS = ["#4ea1ff", "#ffb454", "#5fd38d", "#ff6b6b", "#c792ea", "#8b98a5"];
  const PHASES = [["host", "#c792ea"], ["queue", "#ffb454"], ["prefill", "#4ea1ff"],
                  ["stall", "#ff6b6b"], ["decode", "#5fd38d"], ["client", "#8b98a5"]];
  const params = new URLSearchParams(location.search);
  const interval = Math.max(200, Number(params.get("interval") || 1000));
  const windowS = params.get("window") || "60";
  const state = {polls: 0, errors: [], history: [], last: null, draws: 0};
  window.servelmDashboard = state;

  let key = null;
  const fragment = new URLSearchParams(location.hash.slice(1));
  if (fragment.get("key")) {
    key = fragment.get("key");
    sessionStorage.setItem("servelm-key", key);
    history.replaceState(null, "", location.pathname + location.search);  // out of the bar
  } else {
    key = sessionStorage.getItem("servelm-key");
  }
  document.getElementById("auth-form").addEventListener("submit", function (ev) {
    ev.preventDefault();
    key = document.getElementById("auth-key").value;
    sessionStorage.setItem("servelm-key", key);
    document.getElementById("auth").classList.remove("shown");
    poll();
  });

  function get(obj, path) {
    return path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
  }

  function fmt(v, kind) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    switch (kind) {
      case "pct": return (100 * v).toFixed(1) + "%";
      case "ms": return (1000 * v).toFixed(v < 0.1 ? 1 : 0) + " ms";
      case "s": return v.toFixed(2) + " s";
      case "num": return v >= 100 ? v.toFixed(0) : v.toFixed(1);
      case "int": return Number.isInteger(v) ? String(v) : v.toFixed(1);
      default: return Number.isInteger(v) ? String(v) : v.toFixed(3);
    }
  }

  function renderTiles(d) {
    document.querySelectorAll(".tile .v").forEach(function (el) {
      const v = get(d, el.dataset.key);
      el.textContent = fmt(v, el.dataset.fmt);
      el.dataset.raw = v === null || v === undefined ? "" : String(v);
      const slo = el.dataset.slo ? get(d, el.dataset.slo) : null;
      el.classList.toggle("bad", slo != null && v != null && v > slo);
    });
  }

  function sizeCanvas(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
      canvas.width = Math.round(w * ratio);
      canvas.height = Math.round(h * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    return [ctx, w, h];
  }

  // series: [{name, points: [[x, y], ...]}]; opts: {ref, refLabel, fmt, ymax}
  function lineChart(id, series, opts) {
    const canvas = document.getElementById(id);
    const [ctx, w, h] = sizeCanvas(canvas);
    const pad = {l: 52, r: 8, t: 6, b: 16};
    ctx.clearRect(0, 0, w, h);
    let xs = [], ys = [];
    series.forEach(s => s.points.forEach(p => { if (p[1] != null) { xs.push(p[0]); ys.push(p[1]); } }));
    if (opts.ref != null) ys.push(opts.ref);
    const x0 = xs.length ? Math.min(...xs) : 0, x1 = xs.length ? Math.max(...xs) : 1;
    const ymax = opts.ymax != null ? opts.ymax : Math.max(1e-9, ...ys) * 1.1;
    const X = x => pad.l + (x1 > x0 ? (x - x0) / (x1 - x0) : 1) * (w - pad.l - pad.r);
    const Y = y => h - pad.b - (y / ymax) * (h - pad.t - pad.b);
    ctx.strokeStyle = "#2a3642"; ctx.fillStyle = "#8b98a5"; ctx.font = "10px system-ui";
    ctx.lineWidth = 1;
    for (let i = 0; i <= 2; i++) {
      const y = ymax * i / 2;
      ctx.beginPath(); ctx.moveTo(pad.l, Y(y)); ctx.lineTo(w - pad.r, Y(y)); ctx.stroke();
      ctx.fillText(fmt(y, opts.fmt), 2, Y(y) + 3);
    }
    if (opts.ref != null) {
      ctx.save(); ctx.setLineDash([4, 3]); ctx.strokeStyle = "#ff6b6b";
      ctx.beginPath(); ctx.moveTo(pad.l, Y(opts.ref)); ctx.lineTo(w - pad.r, Y(opts.ref));
      ctx.stroke(); ctx.restore();
    }
    series.forEach(function (s, i) {
      ctx.strokeStyle = COLORS[i % COLORS.length]; ctx.lineWidth = 1.5; ctx.beginPath();
      let started = false;
      s.points.forEach(function (p) {
        if (p[1] == null) { started = false; return; }
        if (!started) { ctx.moveTo(X(p[0]), Y(p[1])); started = true; }
        else ctx.lineTo(X(p[0]), Y(p[1]));
      });
      ctx.stroke();
    });
    const legend = document.querySelector('.legend[data-for="' + id + '"]');
    legend.innerHTML = "";
    series.forEach(function (s, i) {
      const last = s.points.length ? s.points[s.points.length - 1][1] : null;
      const span = document.createElement("span");
      span.innerHTML = '<i style="background:' + COLORS[i % COLORS.length] + '"></i>';
      span.appendChild(document.createTextNode(s.name + " " + fmt(last, opts.fmt)));
      legend.appendChild(span);
    });
    canvas.dataset.points = String(series.reduce((n, s) => n + s.points.length, 0));
  }

  function historySeries(path) {
    return state.history.map(h => [h.t, get(h.d, path) == null ? null : get(h.d, path)]);
  }

  function renderCharts(d) {
    lineChart("c-requests", [{name: "running", points: historySeries("gauges.running")},
                             {name: "waiting", points: historySeries("gauges.waiting")}],
              {fmt: "int"});
    lineChart("c-kv", [{name: "KV usage", points: historySeries("gauges.kv_usage")},
                       {name: "prefix hits", points: historySeries("gauges.prefix_hit_rate")}],
              {fmt: "pct", ymax: 1});
    lineChart("c-ttft", [{name: "p50", points: historySeries("window.ttft_s.p50")},
                         {name: "p90", points: historySeries("window.ttft_s.p90")},
                         {name: "p99", points: historySeries("window.ttft_s.p99")}],
              {fmt: "ms", ref: d.slo.ttft_s});
    lineChart("c-tpot", [{name: "p50", points: historySeries("window.tpot_s.p50")},
                         {name: "p99", points: historySeries("window.tpot_s.p99")}],
              {fmt: "ms", ref: d.slo.tpot_s});
    const maxRate = Math.max(1, ...state.history.map(h => h.d.window.tokens_per_s || 0));
    lineChart("c-tokens", [{name: "tokens/s", points: historySeries("window.tokens_per_s")},
                           {name: "goodput x max", points: state.history.map(
                             h => [h.t, h.d.window.goodput == null ? null : h.d.window.goodput * maxRate])}],
              {fmt: "num"});
    const steps = d.steps || [];
    lineChart("c-steps", [{name: "MBU", points: steps.map(s => [s[0], s[5]])},
                          {name: "MFU", points: steps.map(s => [s[0], s[6]])}],
              {fmt: "pct"});
  }

  function renderWaterfall(d) {
    const svg = document.getElementById("waterfall");
    const rows = d.slowest || [];
    const width = svg.clientWidth || 800, rowH = 18, labelW = 230, top = 14;
    const longest = Math.max(1e-9, ...rows.map(r => Object.values(r.phases).reduce((a, b) => a + b, 0)));
    let html = "";
    PHASES.forEach(function (p, i) {
      html += '<rect x="' + (labelW + i * 90) + '" y="2" width="10" height="8" fill="' + p[1] +
              '"></rect><text class="dim" x="' + (labelW + i * 90 + 14) + '" y="10">' + p[0] + "</text>";
    });
    rows.forEach(function (r, i) {
      const y = top + 6 + i * rowH;
      const label = r.request_id.slice(0, 22) + "  " + r.num_prompt_tokens + "→" +
                    r.num_output_tokens + " tok";
      html += '<text x="0" y="' + (y + 12) + '">' + label.replace(/</g, "&lt;") + "</text>";
      let x = labelW;
      PHASES.forEach(function (p) {
        const v = r.phases[p[0]] || 0;
        const bw = v / longest * (width - labelW - 80);
        if (bw > 0) {
          html += '<rect class="phase" data-phase="' + p[0] + '" x="' + x.toFixed(1) + '" y="' + y +
                  '" width="' + Math.max(0.5, bw).toFixed(1) + '" height="' + (rowH - 4) +
                  '" fill="' + p[1] + '"><title>' + p[0] + " " + fmt(v, "ms") + "</title></rect>";
        }
        x += bw;
      });
      html += '<text class="dim" x="' + (x + 4).toFixed(1) + '" y="' + (y + 12) + '">' +
              fmt(r.latency_s, "ms") + (r.num_preemptions ? " · preempted " + r.num_preemptions : "") +
              "</text>";
    });
    svg.setAttribute("height", String(top + 10 + rows.length * rowH));
    svg.innerHTML = html;
    svg.dataset.rows = String(rows.length);
  }

  function setStatus(text, ok) {
    const el = document.getElementById("status");
    el.textContent = text;
    el.className = ok ? "ok" : "bad";
  }

  async function poll() {
    const headers = key ? {"Authorization": "Bearer " + key} : {};
    let resp;
    try {
      resp = await fetch("dashboard/data?window=" + encodeURIComponent(windowS), {headers: headers, cache: "no-store"});
    } catch (err) {
      setStatus("unreachable", false);
      return;
    }
    if (resp.status === 401) {
      setStatus("API key needed", false);
      document.getElementById("auth").classList.add("shown");
      return;
    }
    if (!resp.ok) {
      setStatus("HTTP " + resp.status, false);
      return;
    }
    const d = await resp.json();
    state.polls += 1;
    state.last = d;
    state.history.push({t: d.time_unix, d: d});
    if (state.history.length > HISTORY) state.history.shift();
    document.getElementById("model").textContent = d.model || "";
    document.getElementById("window").textContent = String(d.window.seconds);
    document.getElementById("polls").textContent = String(state.polls);
    if (d.replicas) {  // the router's view: how many replicas answered
      const up = d.replicas.filter(r => r.reachable).length;
      document.getElementById("replicas").textContent =
        "replicas " + up + "/" + d.replicas.length + " reporting";
    }
    setStatus(d.gauges.engine_alive === 0 ? "engine down" : "live", d.gauges.engine_alive !== 0);
    renderTiles(d);
    renderCharts(d);
    renderWaterfall(d);
    state.draws += 1;
  }

  async function loop() {
    try { await poll(); } catch (err) { state.errors.push(String(err)); console.error(err); }
    setTimeout(loop, interval);
  }
  loop();
})();
