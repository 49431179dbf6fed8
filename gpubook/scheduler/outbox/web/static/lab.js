// gpubook lab page: shows every time in the browser's zone and reloads itself every 30 s. It never writes anything.
"use strict";

const when = new Intl.DateTimeFormat(undefined, {dateStyle: "medium", timeStyle: "short"});

function localTimes() {
  for (const node of document.querySelectorAll("time[datetime]")) {
    const value = node.getAttribute("datetime");
    if (value) {
      node.textContent = when.format(new Date(value));
      node.title = value;
    }
  }
  const zone = document.getElementById("zone");
  if (zone) zone.textContent = Intl.DateTimeFormat().resolvedOptions().timeZone || "local time";
}

document.addEventListener("DOMContentLoaded", () => {
  localTimes();
  document.body.dataset.rendered = "1";  // for tests: the times are local now
  if (document.body.dataset.refresh) setTimeout(() => window.location.reload(), 30000);
});
