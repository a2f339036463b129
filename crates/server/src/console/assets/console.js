// Flotilla console: draws the charts with uPlot. Served from the binary
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

  function init() {
    if (typeof uPlot === "undefined") { return; }
    document.querySelectorAll(".chart[data-series]").forEach(liveChart);
    document.querySelectorAll(".chart[data-json]").forEach(costChart);
  }
  if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", init); } else { init(); }
})();
