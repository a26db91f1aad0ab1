// Cilia Hubble UI: the live service map. Data comes from /api/events (server-sent events,
// the same filters as this page's URL, applied by the relay); the graph is drawn by the
// vendored cytoscape.js (no network needed). For tests and tools the map element carries
// data-nodes / data-edges / data-dropped-edges / data-ready, and window.hubbleMap.cy is the
// cytoscape instance.
"use strict";

const COLORS = { FORWARDED: "#16a34a", DROPPED: "#dc2626", other: "#d97706" };

// Short labels (the line itself must stay visible): "dropped · POLICY_DENIED · TCP/8080",
// "TCP/8080"; the flow count and every port are in the edge's data and the table.
function edgeLabel(e) {
  const parts = e.verdict === "FORWARDED" ? [] : [e.verdict.toLowerCase()];
  if (e.drop_reasons.length) parts.push(e.drop_reasons[0]);
  if (e.ports.length) parts.push(e.ports[0] + (e.ports.length > 1 ? ",…" : ""));
  return parts.join(" · ");
}

function fillForm() {
  const params = new URLSearchParams(location.search);
  for (const el of document.querySelectorAll("#filters [name]")) {
    const value = params.get(el.name);
    if (value !== null) el.value = value;
  }
  // Empty fields are left out of the URL the form makes.
  document.getElementById("filters").addEventListener("submit", (ev) => {
    for (const el of ev.target.querySelectorAll("[name]")) el.disabled = el.value === "";
  });
}

function setStatus(state, text) {
  const el = document.getElementById("status");
  el.dataset.state = state;
  el.textContent = text;
}

function makeMap() {
  return cytoscape({
    container: document.getElementById("map"),
    wheelSensitivity: 0.3,
    maxZoom: 1.6,
    style: [
      { selector: "node", style: {
          "label": "data(label)", "text-valign": "bottom", "text-margin-y": 4,
          "font-size": 11, "background-color": "#3b82f6", "width": 26, "height": 26 } },
      { selector: "node[kind != 'pod']", style: { "background-color": "#64748b", "shape": "round-rectangle" } },
      { selector: "node[kind = 'namespace']", style: {
          "background-color": "#f1f5f9", "background-opacity": 0.8, "border-color": "#94a3b8",
          "border-width": 1, "shape": "round-rectangle", "text-valign": "top",
          "text-margin-y": -4, "font-weight": "bold", "padding": 18 } },
      { selector: "edge", style: {
          "curve-style": "bezier", "control-point-step-size": 60, "width": 3,
          "line-color": COLORS.other, "target-arrow-shape": "triangle",
          "target-arrow-color": COLORS.other, "arrow-scale": 1.3,
          "label": "data(label)", "font-size": 9, "text-rotation": "autorotate",
          "text-margin-y": -6,
          "text-outline-color": "#fff", "text-outline-width": 2, "color": "#334155" } },
      { selector: "edge[verdict = 'FORWARDED']", style: {
          "line-color": COLORS.FORWARDED, "target-arrow-color": COLORS.FORWARDED } },
      { selector: "edge[verdict = 'DROPPED']", style: {
          "line-color": COLORS.DROPPED, "target-arrow-color": COLORS.DROPPED, "width": 5,
          "line-style": "dashed", "line-dash-pattern": [10, 4], "target-arrow-shape": "tee",
          "color": COLORS.DROPPED } },
    ],
    elements: [],
  });
}

function elementsOf(data) {
  const els = [];
  for (const ns of data.namespaces) {
    els.push({ group: "nodes", data: { id: "ns:" + ns, label: ns, kind: "namespace" } });
  }
  for (const n of data.nodes) {
    const d = { id: n.id, label: n.label, kind: n.kind, identity: n.identity,
                namespace: n.namespace, labels: n.labels.join(" ") };
    if (n.namespace) d.parent = "ns:" + n.namespace;
    els.push({ group: "nodes", data: d });
  }
  for (const e of data.edges) {
    els.push({ group: "edges", data: { id: e.id, source: e.source, target: e.target,
      verdict: e.verdict, flows: e.flows, ports: e.ports.join(","),
      drop_reasons: e.drop_reasons.join(","), label: edgeLabel(e) } });
  }
  return els;
}

function updateMap(cy, data) {
  const wanted = elementsOf(data);
  const ids = new Set(wanted.map((e) => e.data.id));
  let changed = false;
  cy.batch(() => {
    cy.elements().forEach((el) => { if (!ids.has(el.id())) { el.remove(); changed = true; } });
    for (const e of wanted) {
      const have = cy.getElementById(e.data.id);
      if (have.empty()) { cy.add(e); changed = true; } else { have.data(e.data); }
    }
  });
  if (changed && cy.nodes().length) {
    cy.layout({ name: "cose", animate: false, nodeDimensionsIncludeLabels: true,
                padding: 40, idealEdgeLength: () => 140, nodeRepulsion: () => 20000 }).run();
    cy.fit(undefined, 40);
  }
  const map = document.getElementById("map");
  map.dataset.nodes = String(data.nodes.length);
  map.dataset.namespaces = String(data.namespaces.length);
  map.dataset.edges = String(data.edges.length);
  map.dataset.droppedEdges = String(data.edges.filter((e) => e.verdict === "DROPPED").length);
  map.dataset.seen = String(data.seen);
  map.dataset.ready = "true";
  document.getElementById("counts").textContent =
    `${data.nodes.length} endpoints · ${data.edges.length} links · ${data.buffered} flows` +
    (data.lost ? ` · ${data.lost} lost` : "");
}

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
}

function updateTable(rows) {
  const body = document.querySelector("#flows tbody");
  const out = document.createDocumentFragment();
  for (const f of rows) {
    const tr = document.createElement("tr");
    tr.dataset.verdict = f.verdict;
    cell(tr, f.time);
    cell(tr, f.node);
    cell(tr, f.source_label, "source");
    cell(tr, f.destination_label, "destination");
    cell(tr, f.l4);
    cell(tr, f.direction + (f.reply ? " (reply)" : ""));
    cell(tr, f.verdict + (f.drop_reason ? " " + f.drop_reason : ""), "verdict");
    out.appendChild(tr);
  }
  body.replaceChildren(out);
}

function main() {
  fillForm();
  if (typeof cytoscape === "undefined") {
    setStatus("error", "the graph library did not load (static/vendor/cytoscape.min.js)");
    return;
  }
  const cy = makeMap();
  window.hubbleMap = { cy };
  const source = new EventSource("/api/events" + location.search);
  source.addEventListener("graph", (ev) => {
    const data = JSON.parse(ev.data);
    updateMap(cy, data);
    updateTable(data.flows);
  });
  source.addEventListener("status", (ev) => {
    const s = JSON.parse(ev.data);
    setStatus(s.state, s.state === "live" ? `live · relay ${s.relay}` : (s.message || s.state));
  });
  source.addEventListener("refused", (ev) => {  // the relay refused these filters
    setStatus("error", JSON.parse(ev.data).message);
    source.close();
  });
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED) {
      setStatus("error", "the server refused the live stream (too many pages open?)");
    } else {
      setStatus("unavailable", "connection to the UI lost; reconnecting…");
    }
  };
}

document.addEventListener("DOMContentLoaded", main);
