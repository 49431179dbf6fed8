// gpubook status page: shows every time in the browser's zone and draws each GPU's day and week
// from the page's embedded data; refreshes the page's content every 15 s. It never writes anything.
"use strict";

const REFRESH_MS = 15000;
const KINDS = ["ended", "booked", "held", "running"];  // drawn in this order: running on top
let view = "day";

const when = new Intl.DateTimeFormat(undefined, {dateStyle: "medium", timeStyle: "short"});
const clock = new Intl.DateTimeFormat(undefined, {hour: "2-digit", minute: "2-digit"});
const dayName = new Intl.DateTimeFormat(undefined, {weekday: "short", day: "numeric", month: "short"});

function localTimes(root) {
  for (const node of root.querySelectorAll("time[datetime]")) {
    const value = node.getAttribute("datetime");
    if (value) {
      node.textContent = when.format(new Date(value));
      node.title = value;
    }
  }
  const zone = document.getElementById("zone");
  if (zone) zone.textContent = Intl.DateTimeFormat().resolvedOptions().timeZone || "local time";
}

// "day": today; "week": this week, Monday to Monday; "next": the week after (the daemon plans a week ahead).
function span(which, now) {
  const start = new Date(now);
  start.setHours(0, 0, 0, 0);
  if (which !== "day") start.setDate(start.getDate() - ((start.getDay() + 6) % 7) + (which === "next" ? 7 : 0));
  const end = new Date(start);
  end.setDate(end.getDate() + (which === "day" ? 1 : 7));
  return [start, end];
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function ticks(track, which, from, to) {
  const step = new Date(from);
  while (step < to) {
    const tick = element("span", "tick", which === "day" ? clock.format(step) : dayName.format(step));
    tick.style.left = (100 * (step - from) / (to - from)) + "%";
    track.appendChild(tick);
    if (which === "day") step.setHours(step.getHours() + 3); else step.setDate(step.getDate() + 1);
  }
}

function segmentNode(segment, from, to) {
  const start = new Date(segment.start), end = new Date(segment.end);
  if (end <= from || start >= to) return null;
  const left = Math.max(start, from), right = Math.min(end, to);
  const node = element("div", "seg seg-" + segment.kind);
  node.style.left = (100 * (left - from) / (to - from)) + "%";
  node.style.width = Math.max(0.15, 100 * (right - left) / (to - from)) + "%";
  node.dataset.booking = segment.booking;
  node.dataset.kind = segment.kind;
  // The title comes from the calendar: only ever textContent and the title attribute, never HTML.
  node.title = [segment.title, segment.kind + ": " + segment.booking,
    segment.user + (segment.template ? " · " + segment.template : ""),
    when.format(start) + " → " + when.format(end), segment.note].filter(Boolean).join("\n");
  node.textContent = segment.user;  // a block is narrow: the title leads its tooltip
  return node;
}

function drawTimeline(container, host, now) {
  const [from, to] = span(view, now);
  container.replaceChildren();
  container.dataset.view = view;
  const scale = element("div", "lane scale");
  scale.appendChild(element("span", "gpu", ""));
  const axis = element("div", "track axis");
  ticks(axis, view, from, to);
  scale.appendChild(axis);
  container.appendChild(scale);
  for (const lane of host.timeline) {
    const row = element("div", "lane");
    row.dataset.gpu = lane.gpu;
    row.appendChild(element("span", "gpu", "GPU " + lane.gpu));
    const track = element("div", "track");
    const ordered = lane.segments.slice().sort((a, b) => KINDS.indexOf(a.kind) - KINDS.indexOf(b.kind));
    for (const segment of ordered) {
      const node = segmentNode(segment, from, to);
      if (node) track.appendChild(node);
    }
    if (now >= from && now < to) {
      const mark = element("div", "now");
      mark.style.left = (100 * (now - from) / (to - from)) + "%";
      track.appendChild(mark);
    }
    row.appendChild(track);
    container.appendChild(row);
  }
}

function render() {
  const source = document.getElementById("page-data");
  if (!source) return;
  const data = JSON.parse(source.textContent);
  const now = new Date();
  localTimes(document);
  for (const host of data.hosts) {
    const section = document.querySelector(`section.host[data-host="${CSS.escape(host.name)}"]`);
    if (!section) continue;
    for (const button of section.querySelectorAll(".views button")) {
      button.classList.toggle("active", button.dataset.view === view);
      button.onclick = () => { view = button.dataset.view; render(); };
    }
    drawTimeline(section.querySelector(".timeline"), host, now);
  }
  document.body.dataset.rendered = String(Date.now());
}

async function refresh() {
  try {
    const answer = await fetch(window.location.href, {cache: "no-store", credentials: "same-origin"});
    if (!answer.ok) return;
    const fresh = new DOMParser().parseFromString(await answer.text(), "text/html").getElementById("page");
    if (fresh) {
      document.getElementById("page").replaceWith(fresh);
      render();
    }
  } catch (error) {
    console.warn("gpubook: refresh failed", error);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  render();
  setInterval(refresh, REFRESH_MS);
});
