// Flotilla console: draws the charts with uPlot, runs tabs and the
// instance terminal (xterm.js). Served from the binary
// (no inline script, so the pages' content security policy forbids any).
(function () {
  "use strict";

  function width(el) {
    return Math.max(280, Math.min(el.clientWidth || 600, 1000));
  }

  // At least a minute wide, so that a young series reads in seconds.
  function span(_, min, max) {
    if (min == null || max == null) { return [min, max]; }
    return [Math.min(min, max - 60), max];
  }

  // Live series of an endpoint: polled every 2 s, redrawn in place.
  function liveChart(el) {
    var url = el.getAttribute("data-series");
    var kind = el.getAttribute("data-kind");
    var plot = null;
    function opts() {
      if (kind === "latency") {
        return {
          width: width(el), height: 220,
          series: [
            {},
            { label: "p95 latency (ms)", stroke: "#b45309", width: 2, spanGaps: true },
            { label: "SLO (ms)", stroke: "#b91c1c", dash: [6, 4], width: 2 },
          ],
          scales: { x: { range: span } },
          axes: [{}, { label: "ms" }],
        };
      }
      return {
        width: width(el), height: 260,
        series: [
          {},
          { label: "ready replicas", stroke: "#1d4ed8", width: 2, paths: uPlot.paths.stepped({ align: 1 }) },
          { label: "desired replicas", stroke: "#7c3aed", dash: [4, 4], width: 2, paths: uPlot.paths.stepped({ align: 1 }) },
          { label: "requests/s", stroke: "#047857", width: 2, scale: "rps" },
        ],
        scales: { x: { range: span }, rps: {} },
        axes: [{}, { label: "replicas" }, { side: 1, scale: "rps", label: "requests/s", grid: { show: false } }],
      };
    }
    function data(points) {
      var t = points.map(function (p) { return p.t; });
      if (kind === "latency") {
        return [t, points.map(function (p) { return p.p95_ms; }), points.map(function (p) { return p.slo_ms; })];
      }
      return [t, points.map(function (p) { return p.ready; }), points.map(function (p) { return p.desired; }),
              points.map(function (p) { return p.rps; })];
    }
    function tick() {
      fetch(url, { credentials: "same-origin", headers: { "Accept": "application/json" } })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (body) {
          if (!body) { return; }
          var d = data(body.points || []);
          el.setAttribute("data-points", String(d[0].length));
          if (!plot) { el.textContent = ""; plot = new uPlot(opts(), d, el); } else { plot.setData(d); }
        })
        .catch(function () {})
        .then(function () { if (document.body.contains(el)) { setTimeout(tick, 2000); } });
    }
    tick();
    window.addEventListener("resize", function () { if (plot) { plot.setSize({ width: width(el), height: plot.height }); } });
  }

  // Cost by month: bars from a JSON data block of the page.
  function costChart(el) {
    var src = document.getElementById(el.getAttribute("data-json"));
    if (!src) { return; }
    var d = JSON.parse(src.textContent);
    var xs = d.months.map(function (_, i) { return i; });
    var plot = new uPlot({
      width: width(el), height: 220,
      scales: { x: { time: false, range: [-0.5, Math.max(xs.length - 0.5, 0.5)] } },
      series: [{}, { label: "total (" + d.currency + ")", fill: "rgba(29,78,216,0.6)", stroke: "#1d4ed8",
                     paths: uPlot.paths.bars({ size: [0.6, 80] }) }],
      axes: [{ values: function (_, ticks) { return ticks.map(function (i) { return d.months[i] || ""; }); }, splits: function () { return xs; } },
             { label: d.currency }],
    }, [xs, d.totals], el);
    el.setAttribute("data-points", String(xs.length));
    window.addEventListener("resize", function () { plot.setSize({ width: width(el), height: 220 }); });
  }

  // Tabs (the instance page's Logs and Terminal): ARIA tabs, arrow keys
  // move between them; "#terminal" in the address opens that tab.
  function tabs(list) {
    var all = Array.prototype.slice.call(list.querySelectorAll('[role="tab"]'));
    function select(tab, focus) {
      all.forEach(function (t) {
        var on = t === tab;
        t.setAttribute("aria-selected", on ? "true" : "false");
        t.tabIndex = on ? 0 : -1;
        var panel = document.getElementById(t.getAttribute("aria-controls"));
        if (panel) { panel.hidden = !on; }
      });
      if (focus) { tab.focus(); }
      var panel = document.getElementById(tab.getAttribute("aria-controls"));
      if (panel) { panel.dispatchEvent(new CustomEvent("tab-shown")); }
    }
    all.forEach(function (t, i) {
      t.addEventListener("click", function () { select(t, false); });
      t.addEventListener("keydown", function (e) {
        var step = e.key === "ArrowRight" ? 1 : e.key === "ArrowLeft" ? -1 : 0;
        if (step) { e.preventDefault(); select(all[(i + step + all.length) % all.length], true); }
      });
    });
    var wanted = all.filter(function (t) { return "#" + t.id.replace(/^tab-/, "") === location.hash; })[0];
    if (wanted) { select(wanted, false); }
  }

  // The terminal: xterm.js over the console's WebSocket, which carries the
  // API's session frames (docs/access.md): one tag byte, then the payload.
  var STDIN = 0, STDOUT = 1, STDERR = 2, RESIZE = 4, EXIT = 5, ERROR = 6;
  function terminal(el) {
    if (typeof Terminal === "undefined" || typeof FitAddon === "undefined") { return; }
    var panel = el.closest('[role="tabpanel"]') || el.parentNode;
    var status = document.getElementById("terminal-status");
    var again = document.getElementById("terminal-reconnect");
    var term = new Terminal({
      cursorBlink: true, fontSize: 14, scrollback: 5000,
      fontFamily: 'ui-monospace, Menlo, Consolas, "DejaVu Sans Mono", monospace',
    });
    var fit = new FitAddon.FitAddon();
    term.loadAddon(fit);
    var ws = null, started = false, encoder = new TextEncoder(), decoder = new TextDecoder();
    function say(state, text) { status.setAttribute("data-state", state); status.textContent = text; }
    function send(tag, payload) {
      if (!ws || ws.readyState !== WebSocket.OPEN) { return; }
      var m = new Uint8Array(payload.length + 1);
      m[0] = tag; m.set(payload, 1);
      ws.send(m);
    }
    function refit() { if (!panel.hidden) { try { fit.fit(); } catch (e) { /* not laid out yet */ } } }
    term.onData(function (d) { send(STDIN, encoder.encode(d)); });
    term.onBinary(function (d) {
      var b = new Uint8Array(d.length);
      for (var i = 0; i < d.length; i++) { b[i] = d.charCodeAt(i) & 255; }
      send(STDIN, b);
    });
    term.onResize(function (size) {
      send(RESIZE, [size.cols >> 8, size.cols & 255, size.rows >> 8, size.rows & 255]);
    });
    function connect() {
      // Opened once shown: a hidden element has no size to measure.
      if (!started) { term.open(el); }
      started = true;
      again.disabled = true;
      refit();
      var url = new URL(el.getAttribute("data-ws"), location.href);
      url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
      url.searchParams.set("csrf", el.getAttribute("data-csrf"));
      url.searchParams.set("cols", String(term.cols));
      url.searchParams.set("rows", String(term.rows));
      var ended = false;
      say("connecting", "Connecting…");
      var sock = new WebSocket(url.toString());
      sock.binaryType = "arraybuffer";
      ws = sock;
      sock.onopen = function () { say("connected", "Connected"); term.focus(); };
      sock.onmessage = function (ev) {
        var b = new Uint8Array(ev.data);
        if (b.length === 0) { return; }
        var p = b.subarray(1);
        if (b[0] === STDOUT || b[0] === STDERR) {
          term.write(p);
        } else if (b[0] === EXIT && p.length === 4) {
          var code = new DataView(b.buffer, b.byteOffset + 1, 4).getInt32(0);
          ended = true;
          say("ended", "The session ended with exit code " + code);
          term.write("\r\n[exit code " + code + "]\r\n");
        } else if (b[0] === ERROR) {
          var msg = decoder.decode(p);
          ended = true;
          say("failed", "The session failed: " + msg);
          term.write("\r\n[" + msg + "]\r\n");
        }
      };
      sock.onclose = function () {
        if (ws === sock) { ws = null; }
        if (!ended) { say("closed", "Disconnected"); }
        again.disabled = false;
      };
    }
    again.addEventListener("click", function () { term.reset(); connect(); });
    panel.addEventListener("tab-shown", function () { if (!started) { connect(); } else { refit(); } });
    window.addEventListener("resize", refit);
    if (!panel.hidden) { connect(); }
  }

  function init() {
    document.querySelectorAll('[role="tablist"]').forEach(tabs);
    document.querySelectorAll(".terminal[data-ws]").forEach(terminal);
    if (typeof uPlot === "undefined") { return; }
    document.querySelectorAll(".chart[data-series]").forEach(liveChart);
    document.querySelectorAll(".chart[data-json]").forEach(costChart);
  }
  // After DOMContentLoaded: the instance page's own deferred scripts
  // (xterm.js) run after this one, and before that event.
  if (document.readyState === "complete") { init(); } else { document.addEventListener("DOMContentLoaded", init); }
})();
