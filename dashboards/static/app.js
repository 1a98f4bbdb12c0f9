// lightspan web UI: plain JavaScript modules, no build step. This module routes the address's
// #fragment to a page; each page is its own module, the shared helpers are lib.js.

import {healthPage} from "./health.js";
import {main, showError, statusLine} from "./lib.js";
import {qualityPage} from "./quality.js";
import {queuePage} from "./queue.js";
import {rolloutPage} from "./rollout.js";
import {rolloutsPage} from "./rollouts.js";
import {trainingPage} from "./training.js";

let pollTimer = null;

document.getElementById("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("lightspan-token", document.getElementById("token").value.trim());
  document.getElementById("token-form").hidden = true;
  route();
});

async function route() {
  clearTimeout(pollTimer);
  const hash = location.hash.replace(/^#/, "") || "/rollouts";
  const [path, query] = hash.split("?");
  const params = new URLSearchParams(query || "");
  const page = path.split("/")[1];
  for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("active", a.dataset.page === (page === "rollout" ? "rollouts" : page));
  main.dataset.state = "loading";
  statusLine.textContent = "";
  try {
    if (page === "rollout") await rolloutPage(decodeURIComponent(path.slice("/rollout/".length)));
    else if (page === "queue") await queuePage(params);
    else if (page === "training") await trainingPage(params);
    else if (page === "quality") await qualityPage(params);
    else if (page === "health") {
      await healthPage();
      const tick = async () => {
        if (!location.hash.startsWith("#/health")) return;
        try { await healthPage(); } catch (err) { showError(err); }
        pollTimer = setTimeout(tick, 2000);
      };
      pollTimer = setTimeout(tick, 2000);
    } else await rolloutsPage(params);
  } catch (err) {
    showError(err);
  }
}

window.addEventListener("hashchange", route);
route();
