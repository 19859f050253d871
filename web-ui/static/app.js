// Keeps the parts of a dashboard page marked `data-live` current without a reload:
// every few seconds, while the tab is visible, it fetches the same page and swaps in
// the new versions of those parts. The pages are complete without it.
(function () {
  "use strict";
  const live = () => Array.from(document.querySelectorAll("[data-live][id]"));
  if (live().length === 0) return;
  const status = document.getElementById("live-status");
  const PERIOD_MS = 2000;
  let stopped = false;

  function say(text) {
    if (status) status.textContent = text;
  }

  // A region holding the keyboard focus is left alone until the focus leaves it, so
  // that a keyboard user's place (or half-typed input) is never thrown away.
  function busy(region) {
    const active = document.activeElement;
    return active && active !== document.body && region.contains(active);
  }

  async function refresh() {
    if (stopped || document.hidden) return;
    try {
      const response = await fetch(window.location.href, {
        credentials: "same-origin",
        headers: { "Accept": "text/html" },
        cache: "no-store",
      });
      if (response.redirected || response.status === 401 || response.status === 403) {
        stopped = true;
        say("Signed out: reload to sign in again.");
        return;
      }
      if (!response.ok) {
        say("Live updates paused (server answered " + response.status + ").");
        return;
      }
      const html = await response.text();
      const next = new DOMParser().parseFromString(html, "text/html");
      for (const region of live()) {
        const fresh = next.getElementById(region.id);
        if (!fresh || busy(region) || fresh.innerHTML === region.innerHTML) continue;
        region.replaceWith(document.importNode(fresh, true));
      }
      say("Live · updated " + new Date().toLocaleTimeString());
    } catch (e) {
      say("Live updates paused (server unreachable).");
    }
  }

  say("Live");
  window.setInterval(refresh, PERIOD_MS);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
})();
