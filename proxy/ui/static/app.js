/* Splice session viewer: plain script, no build step, talks to this proxy only (/ui/api/*). */
"use strict";

const FIRST_PAGE = 512; // tokens of a sample drawn when the page opens
const PAGE = 2048; // tokens per later request, as the reader scrolls
const SEG_NAMES = ["text", "reasoning", "tool call", "special", "image"];
const CHANNELS = {
  version: "policy version",
  logprob: "behaviour log-prob",
  delta: "proximal − behaviour",
  mask: "loss mask",
  src: "bridge vs sampled",
};
const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f", "#bab0ac"];

const $ = (sel, root = document) => root.querySelector(sel);
const el = (tag, props = {}, ...kids) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) e.setAttribute(k, v);
  }
  for (const kid of kids) if (kid !== null && kid !== undefined) e.append(kid);
  return e;
};
const fmt = (x, d = 4) => (x === null || x === undefined ? "—" : Number(x).toFixed(d));
const when = (t) => (t ? new Date(t * 1000).toLocaleString() : "—");
// an episode role's badge (proxy/session/roles.py): main is the agent's own conversation,
// the others are set apart
const roleBadge = (role) => el("span", { class: "role role-" + role, "data-role": role, text: role });
const short = (s, n = 28) => (s && s.length > n ? s.slice(0, n - 1) + "…" : s || "");

// ---------------------------------------------------------------- credentials and requests

function token() {
  return sessionStorage.getItem("splice-token") || "";
}

function takeTokenFromHash() {
  // "#/s/<id>?token=..." or "#token=...": kept for this tab only, then removed from the address
  const h = location.hash;
  const m = h.match(/[?&#]token=([^&]*)/);
  if (!m) return;
  sessionStorage.setItem("splice-token", decodeURIComponent(m[1]));
  history.replaceState(null, "", location.pathname + h.replace(/[?&]?token=[^&]*/, "").replace(/^#$/, "#/"));
}

class Unauthorized extends Error {}

async function api(path, params = {}) {
  const qs = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== "" && v !== null && v !== undefined) qs.set(k, v);
  const url = "/ui/api/" + path + (qs.toString() ? "?" + qs : "");
  const headers = token() ? { Authorization: "Bearer " + token() } : {};
  const r = await fetch(url, { headers, cache: "no-store" });
  if (r.status === 401) throw new Unauthorized();
  const body = await r.json();
  if (!r.ok) throw new Error((body.error && body.error.message) || r.statusText);
  return body;
}

async function imageUrl(hash) {
  const headers = token() ? { Authorization: "Bearer " + token() } : {};
  const r = await fetch("/ui/api/images/" + hash, { headers });
  if (!r.ok) throw new Error("image " + hash + ": " + r.status);
  return URL.createObjectURL(await r.blob());
}

function showLogin(message) {
  const form = $("#login");
  form.hidden = false;
  $("#login-error").textContent = message || "";
  $("#main").replaceChildren();
}

$("#login") && $("#login").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("splice-token", $("#token").value);
  $("#login").hidden = true;
  route();
});

// ---------------------------------------------------------------- routing

let timer = null;

async function route() {
  clearInterval(timer);
  $("#tip").hidden = true;
  const h = location.hash.replace(/^#/, "") || "/";
  const [path, query] = h.split("?");
  const params = new URLSearchParams(query || "");
  document.body.dataset.ready = "";
  try {
    if (path.startsWith("/s/")) await sessionPage(decodeURIComponent(path.slice(3)));
    else if (path === "/now") await nowPage();
    else await sessionsPage(params);
    document.body.dataset.ready = "1";
  } catch (err) {
    if (err instanceof Unauthorized) showLogin(token() ? "That token was refused." : "");
    else $("#main").replaceChildren(el("p", { class: "error", text: String(err.message || err) }));
    document.body.dataset.ready = "error";
  }
}

// ---------------------------------------------------------------- sessions table

const FILTERS = ["q", "group", "role", "rewarded", "fork_reason", "has_images", "engine", "version_min", "version_max", "limit"];

async function sessionsPage(params) {
  const choices = await api("choices");
  const main = $("#main");
  const tri = (name, label) =>
    el("label", {}, label + " ", el("select", { name },
      el("option", { value: "", text: "any" }), el("option", { value: "true", text: "yes" }), el("option", { value: "false", text: "no" })));
  const reasons = el("select", { name: "fork_reason" }, el("option", { value: "", text: "any" }), el("option", { value: "*", text: "any fork" }),
    ...choices.fork_reasons.map((r) => el("option", { value: r, text: r })));
  const roles = el("select", { name: "role" }, el("option", { value: "", text: "any" }),
    ...choices.roles.map((r) => el("option", { value: r, text: r })));
  const engines = el("select", { name: "engine" }, el("option", { value: "", text: "any" }),
    ...choices.engines.map((r) => el("option", { value: r, text: r })));
  const form = el("form", { id: "filters" },
    el("label", {}, "session ", el("input", { name: "q", placeholder: "id prefix", size: 14 })),
    el("label", {}, "group ", el("input", { name: "group", size: 10 })),
    el("label", { title: "sessions holding a turn of this episode role" }, "role ", roles),
    tri("rewarded", "rewarded"),
    el("label", {}, "fork ", reasons),
    tri("has_images", "images"),
    el("label", {}, "engine ", engines),
    el("label", {}, "versions ", el("input", { name: "version_min", type: "number", class: "num" }), "–",
      el("input", { name: "version_max", type: "number", class: "num" })),
    el("label", {}, "per page ", el("input", { name: "limit", type: "number", class: "num", min: 1, max: 200, value: 50 })),
    el("button", { type: "submit", text: "Filter" }));
  for (const k of FILTERS) if (params.get(k) !== null && form.elements[k]) form.elements[k].value = params.get(k);
  const table = el("table", { id: "sessions-table", class: "grid" },
    el("thead", {}, el("tr", {}, ...["session", "group", "roles", "turns", "tokens", "context", "reward", "forks", "staleness", "images", "last activity"]
      .map((h) => el("th", { text: h })))), el("tbody"));
  const pager = el("div", { class: "pager" },
    el("button", { id: "prev", type: "button", text: "← newer" }), el("span", { id: "page-no" }),
    el("button", { id: "next", type: "button", text: "older →" }));
  main.replaceChildren(el("h2", { text: "Sessions" }), form, table, pager);

  const cursors = [""]; // cursors[k]: the cursor of page k
  let pageNo = 0;
  const filters = () => Object.fromEntries(FILTERS.map((k) => [k, form.elements[k].value]));
  async function load() {
    const body = await api("sessions", { ...filters(), cursor: cursors[pageNo] });
    const rows = body.data.map((s) =>
      el("tr", { "data-session": s.session_id },
        el("td", {}, el("a", { href: "#/s/" + encodeURIComponent(s.session_id), text: short(s.session_id, 36), title: s.session_id })),
        el("td", { text: s.group_id || "" }),
        el("td", { class: "roles" }, ...s.roles.map(roleBadge)),
        el("td", { class: "n", text: s.turns }), el("td", { class: "n", text: s.tokens }), el("td", { class: "n", text: s.context }),
        el("td", { class: "n", text: s.reward === null ? "—" : s.reward }),
        el("td", { class: "n", text: s.forks }),
        el("td", { class: "n", text: s.staleness === null ? "—" : s.staleness }),
        el("td", { text: s.has_images ? "yes" : "" }),
        el("td", { text: when(s.last_activity) })));
    $("tbody", table).replaceChildren(...rows);
    if (!rows.length) $("tbody", table).append(el("tr", {}, el("td", { colspan: 11, class: "empty", text: "no sessions" })));
    cursors[pageNo + 1] = body.next_cursor;
    $("#page-no").textContent = "page " + (pageNo + 1) +
      (body.scanned_to ? ` (looked through sessions back to ${when(body.scanned_to)}; older → looks further)` : "");
    $("#prev").disabled = pageNo === 0;
    $("#next").disabled = !body.has_more;
    document.body.dataset.page = String(pageNo + 1);
  }
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    pageNo = 0;
    cursors.length = 1;
    const qs = new URLSearchParams(Object.entries(filters()).filter(([, v]) => v !== ""));
    history.replaceState(null, "", "#/" + (qs.toString() ? "?" + qs : ""));
    await guarded(load);
  });
  $("#next").addEventListener("click", () => { pageNo += 1; guarded(load); });
  $("#prev").addEventListener("click", () => { pageNo = Math.max(0, pageNo - 1); guarded(load); });
  await load();
}

async function guarded(fn) {
  document.body.dataset.ready = "";
  try {
    await fn();
    document.body.dataset.ready = "1";
  } catch (err) {
    if (err instanceof Unauthorized) showLogin("");
    else $("#main").append(el("p", { class: "error", text: String(err.message || err) }));
    document.body.dataset.ready = "error";
  }
}

// ---------------------------------------------------------------- one session

function colour(channel, d, i) {
  const sampled = d.src[i] === 1;
  switch (channel) {
    case "version":
      return d.version[i] < 0 ? "#d9d9d9" : PALETTE[d.version[i] % PALETTE.length];
    case "logprob": {
      if (!sampled) return "#d9d9d9";
      const x = Math.max(0, Math.min(1, 1 + d.logprob[i] / 8)); // 0 nats green .. -8 red
      return `hsl(${Math.round(120 * x)}, 70%, 55%)`;
    }
    case "delta": {
      if (!sampled) return "#d9d9d9";
      const x = Math.max(-1, Math.min(1, d.proximal[i] - d.logprob[i]));
      const l = Math.round(97 - 47 * Math.abs(x));
      return x >= 0 ? `hsl(0, 75%, ${l}%)` : `hsl(215, 75%, ${l}%)`;
    }
    case "mask":
      return d.mask[i] ? "#59a14f" : "#e0e0e0";
    default:
      return sampled ? "#4e79a7" : "#f28e2b";
  }
}

function legend(channel) {
  const sw = (c, t) => el("span", { class: "sw" }, swatch(c), t);
  const swatch = (c) => { const s = el("i"); s.style.background = c; return s; };
  const items = {
    version: [...PALETTE.slice(0, 4).map((c, v) => sw(c, "v" + v + "  ")), sw("#d9d9d9", "context")],
    logprob: [sw("hsl(120,70%,55%)", "0"), sw("hsl(60,70%,55%)", "−4"), sw("hsl(0,70%,55%)", "≤ −8 nats")],
    delta: [sw("hsl(215,75%,50%)", "−1"), sw("hsl(0,75%,97%)", "0"), sw("hsl(0,75%,50%)", "+1 (proximal higher)")],
    mask: [sw("#59a14f", "trained (1)"), sw("#e0e0e0", "not (0)")],
    src: [sw("#4e79a7", "sampled"), sw("#f28e2b", "bridge / context")],
  }[channel];
  return el("span", { id: "legend" }, ...items);
}

function treeView(turns, onPick) {
  const kids = new Map();
  const ids = new Set(turns.map((t) => t.turn_id));
  for (const t of turns) {
    const p = t.parent_turn_id && ids.has(t.parent_turn_id) ? t.parent_turn_id : "";
    if (!kids.has(p)) kids.set(p, []);
    kids.get(p).push(t);
  }
  const node = (t) => {
    const edge = t.edge === "fork" ? "fork: " + (t.fork_reason || "?") : t.edge;
    const label = el("a", { href: "#", class: "turn-link", onclick: (ev) => { ev.preventDefault(); onPick(t); } },
      `#${t.index}`, el("span", { class: "edge " + t.edge, text: edge }), roleBadge(t.role),
      ` ${t.n_prompt}+${t.n_output} tok · v${t.version_min ?? "–"}${t.version_max !== t.version_min ? "→" + t.version_max : ""} · ${t.finish_reason}`,
      t.abandoned ? el("span", { class: "bad", text: " abandoned" }) : null,
      t.drift ? el("span", { class: "warn", text: " drift avoided" }) : null,
      t.trainable ? null : el("span", { class: "bad", text: " untrainable" }));
    const li = el("li", { class: `edge-${t.edge} role-${t.role}` + (t.role === "main" ? "" : " aux"), "data-turn-id": t.turn_id,
      "data-index": t.index, "data-role": t.role, title: t.role === "main" ? null : `a ${t.role} turn, not the agent's main conversation` }, label);
    const sub = kids.get(t.turn_id);
    if (sub) li.append(el("ul", {}, ...sub.map(node)));
    return li;
  };
  return el("ul", { id: "tree" }, ...(kids.get("") || []).map(node));
}

class TokenView {
  /** One sample's tokens, fetched and drawn a page at a time as the reader scrolls. */
  constructor(sessionId, k, sample, turns, channel) {
    this.sessionId = sessionId;
    this.k = k;
    this.sample = sample;
    this.turns = turns;
    this.channel = channel;
    this.pages = [];
    this.loaded = 0;
    this.lastOwner = -2;
    this.busy = null;
    this.body = el("div", { class: "tokens", id: "sample-" + k });
    this.more = el("div", { class: "more", text: "…" });
    this.canvas = el("canvas", { class: "overview", width: 1200, height: 14, title: "the whole sample: click to go there" });
    this.canvas.addEventListener("click", (ev) => this.jump(ev));
    this.root = el("section", { class: "sample", "data-sample": k },
      el("h3", {}, `Sample ${sample.sample_id} · ${sample.n_tokens} tokens · ${sample.loss_tokens} trained` +
        (sample.trainable ? "" : " · untrainable") + " · ", roleBadge(sample.role),
        sample.pulled ? null : el("span", { class: "muted", text: " a side call: not handed to the trainer (--train-auxiliary)" })),
      this.canvas, this.body, this.more);
    this.observer = new IntersectionObserver((es) => es.some((e) => e.isIntersecting) && this.next(), { rootMargin: "600px" });
    this.observer.observe(this.more);
  }

  next() {
    if (this.busy) return this.busy;
    if (this.loaded >= this.sample.n_tokens) return Promise.resolve();
    const count = this.loaded ? PAGE : FIRST_PAGE;
    this.busy = api("tokens", { id: this.sessionId, sample: this.k, start: this.loaded, count })
      .then((d) => this.draw(d))
      .finally(() => { this.busy = null; });
    return this.busy;
  }

  async until(index) {
    while (this.loaded <= index && this.loaded < this.sample.n_tokens) await this.next();
  }

  draw(d) {
    const t0 = performance.now();
    const p = this.pages.length;
    this.pages.push(d);
    const strip = el("div", { class: "strip", "data-page": p });
    const text = el("div", { class: "text", "data-page": p });
    const imgs = new Map(d.images.map((im) => [im.offset, im]));
    const frag = document.createDocumentFragment();
    for (let j = 0; j < d.ids.length; j++) {
      const i = d.start + j;
      const owner = d.turn[j];
      if (owner !== this.lastOwner) {
        this.lastOwner = owner;
        const t = this.turns[owner];
        frag.append(el("div", { class: "turn-head", id: `turn-${this.k}-${t.index}`, "data-turn-id": t.turn_id },
          `Turn #${t.index} · `, el("span", { class: "edge " + t.edge, text: t.edge === "fork" ? "fork: " + t.fork_reason : t.edge }), roleBadge(t.role),
          ` · ${t.finish_reason} · ${t.api}`));
      }
      if (d.src[j] === 1 && (j === 0 || d.src[j - 1] === 0 || d.turn[j - 1] !== owner)) {
        frag.append(el("span", { class: "out-mark", text: "▸", title: "sampled by the model from here" }));
      }
      const cell = document.createElement("span");
      cell.className = "c";
      cell.setAttribute("data-i", i);
      cell.style.background = colour(this.channel, d, j);
      strip.append(cell);
      if (d.seg[j] === 4) { // an image: one picture for its placeholder run
        const im = imgs.get(i);
        if (im) {
          const img = el("img", { class: "inline-img", alt: "image " + im.hash.slice(0, 12), "data-hash": im.hash, "data-i": i });
          imageUrl(im.hash).then((u) => { img.src = u; }).catch(() => { img.alt += " (not loaded)"; });
          frag.append(el("span", { class: "t seg-4", "data-i": i, title: `${im.length} image tokens` }, img));
        }
        continue;
      }
      const span = document.createElement("span");
      span.className = `t seg-${d.seg[j]} src-${d.src[j]}`;
      span.setAttribute("data-i", i);
      span.textContent = d.text[j];
      frag.append(span);
    }
    text.append(frag);
    this.body.append(strip, text);
    this.loaded = d.end;
    window.spliceDrawMs = performance.now() - t0;
    if (this.loaded >= this.sample.n_tokens) {
      this.observer.disconnect();
      this.more.remove();
    } else if (this.more.getBoundingClientRect().top < window.innerHeight + 600) {
      setTimeout(() => this.next(), 0); // still in view: the observer reports changes only
    }
  }

  async loadOverview() {
    this.summary = await api("overview", { id: this.sessionId, sample: this.k, buckets: this.canvas.width });
    this.paintOverview();
  }

  paintOverview() {
    const o = this.summary;
    if (!o) return;
    const ctx = this.canvas.getContext("2d");
    const w = this.canvas.width / o.starts.length;
    o.starts.forEach((_, b) => {
      // one bucket drawn as a token would be: the bucket's figure in the token's fields
      const d = { src: [o.src[b] > 0 ? 1 : 0], version: [o.version[b]], logprob: [o.logprob[b] ?? 0],
        proximal: [(o.logprob[b] ?? 0) + o.delta[b]], mask: [o.mask[b] > 0 ? 1 : 0] };
      ctx.fillStyle = colour(this.channel, d, 0);
      ctx.fillRect(Math.floor(b * w), 0, Math.ceil(w), this.canvas.height);
    });
  }

  async jump(ev) {
    const r = this.canvas.getBoundingClientRect();
    const index = Math.floor(((ev.clientX - r.left) / r.width) * this.sample.n_tokens);
    await this.until(index);
    const t = this.body.querySelector(`.text [data-i="${index}"]`) || this.body.querySelector(`.strip [data-i="${index}"]`);
    if (t) t.scrollIntoView({ block: "center" });
  }

  recolour(channel) {
    this.channel = channel;
    this.paintOverview();
    this.pages.forEach((d, p) => {
      const cells = this.body.querySelectorAll(`.strip[data-page="${p}"] .c`);
      cells.forEach((c, j) => { c.style.background = colour(channel, d, j); });
    });
  }

  figures(i) {
    const d = this.pages.find((x) => x.start <= i && i < x.end);
    if (!d) return null;
    const j = i - d.start;
    const t = this.turns[d.turn[j]];
    return { i, j, d, t };
  }
}

function tipText(f) {
  const { i, j, d, t } = f;
  const sampled = d.src[j] === 1;
  const lines = [
    `token ${i} · id ${d.ids[j]} · ${JSON.stringify(d.text[j])}`,
    `turn #${t.index} · ${sampled ? "sampled" : "bridge / context"} · ${SEG_NAMES[d.seg[j]]} · mask ${d.mask[j]}`,
  ];
  if (sampled) {
    lines.push(`version ${d.version[j]} · behaviour ${fmt(d.logprob[j], 6)}`);
    lines.push(`proximal ${fmt(d.proximal[j], 6)} (v${d.proximal_version[j]}) · Δ ${fmt(d.proximal[j] - d.logprob[j], 6)}`);
  }
  return lines.join("\n");
}

async function sessionPage(sid) {
  const t0 = performance.now();
  const s = await api("session", { id: sid });
  const sess = s.session;
  const main = $("#main");
  const channel = el("select", { id: "channel" }, ...Object.entries(CHANNELS).map(([k, v]) => el("option", { value: k, text: v })));
  const head = el("div", { class: "head" },
    el("h2", { text: "Session " + sess.session_id }),
    el("p", {}, `group ${sess.group_id || "—"} · reward `, el("b", { id: "reward", text: sess.reward === null ? "none yet" : sess.reward }),
      ` · ${sess.closed ? "closed" : "open"} · ${sess.acked ? "acked" : sess.leased ? "leased" : "not pulled"}`,
      ` · ${s.turns.length} turns (`, ...Object.entries(s.roles).flatMap(([r, n], k) => [k ? ", " : "", roleBadge(r), " ×" + n]), ")",
      ` · ${s.n_tokens} tokens · forks: ${Object.entries(s.forks).map(([k, v]) => k + " ×" + v).join(", ") || "none"}`,
      ` · proxy at v${s.version}`));
  const samples = el("table", { id: "samples", class: "grid" },
    el("thead", {}, el("tr", {}, ...["sample", "role", "tokens", "trained", "turns", "versions", "images", "reward", "trainable", "pulled"].map((h) => el("th", { text: h })))),
    el("tbody", {}, ...s.samples.map((x) => el("tr", {},
      el("td", { text: x.sample_id }), el("td", {}, roleBadge(x.role)), el("td", { class: "n", text: x.n_tokens }), el("td", { class: "n", text: x.loss_tokens }),
      el("td", { text: x.turns.map((t) => "#" + t.index).join(" ") }),
      el("td", { text: x.version_min === null ? "—" : x.version_min === x.version_max ? "v" + x.version_min : `v${x.version_min}–v${x.version_max}` }),
      el("td", { class: "n", text: x.images.length }), el("td", { text: x.reward === null ? "—" : x.reward }),
      el("td", { text: x.trainable ? "yes" : "no" }), el("td", { text: x.pulled ? "yes" : "no" })))));
  const views = s.samples.map((x, k) => new TokenView(sid, k, x, s.turns, channel.value));
  const pick = async (t) => {
    if (!t.placement) return;
    const v = views[t.placement.sample];
    await v.until(t.placement.context_start);
    const h = document.getElementById(`turn-${t.placement.sample}-${t.index}`);
    if (h) h.scrollIntoView({ block: "start" });
  };
  channel.addEventListener("change", () => {
    views.forEach((v) => v.recolour(channel.value));
    $("#legend").replaceWith(legend(channel.value));
  });
  main.replaceChildren(head,
    el("div", { class: "cols" },
      el("aside", {}, el("h3", { text: "Turns" }), treeView(s.turns, pick), el("h3", { text: "Samples" }), samples),
      el("div", { class: "view" },
        el("div", { class: "controls" }, el("label", {}, "colour by ", channel), legend(channel.value)),
        ...views.map((v) => v.root),
        s.samples.length ? null : el("p", { class: "empty", text: "No samples: every turn was abandoned, or none yet." }))));
  const tip = $("#tip");
  main.addEventListener("mouseover", (ev) => {
    const c = ev.target.closest("[data-i]");
    const sec = ev.target.closest(".sample");
    if (!c || !sec) return;
    const f = views[Number(sec.dataset.sample)].figures(Number(c.dataset.i));
    if (!f) return;
    tip.textContent = tipText(f);
    tip.hidden = false;
    const r = c.getBoundingClientRect();
    tip.style.left = Math.min(window.innerWidth - 360, r.left + window.scrollX) + "px";
    tip.style.top = r.bottom + window.scrollY + 6 + "px";
    sec.querySelectorAll(".hl").forEach((x) => x.classList.remove("hl"));
    sec.querySelectorAll(`[data-i="${c.dataset.i}"]`).forEach((x) => x.classList.add("hl"));
  });
  main.addEventListener("mouseleave", () => { tip.hidden = true; });
  await Promise.all(views.map((v) => v.next()));
  document.body.offsetHeight; // lay the first page out before the clock stops
  await new Promise((r) => requestAnimationFrame(() => setTimeout(r, 0)));
  window.spliceOpenMs = performance.now() - t0; // read by the benchmark: from the route to drawn
  window.spliceDrawnAt = performance.now(); // from navigation start
  await Promise.all(views.map((v) => v.loadOverview()));
}

// ---------------------------------------------------------------- now

async function nowPage() {
  const draw = async () => {
    const n = await api("now");
    const engines = el("table", { id: "engines", class: "grid" },
      el("thead", {}, el("tr", {}, ...["engine", "url", "healthy", "weights", "rotation", "in flight"].map((h) => el("th", { text: h })))),
      el("tbody", {}, ...n.engines.map((e) => el("tr", {},
        el("td", { text: short(e.id, 24) }), el("td", { text: e.url }), el("td", { text: e.healthy ? "yes" : "no" }),
        el("td", { text: e.weight_version === null ? "—" : "v" + e.weight_version }),
        el("td", { text: e.in_rotation ? "in" : "out (v" + e.out_of_rotation + ")" }), el("td", { class: "n", text: e.in_flight ?? "—" })))));
    const updates = el("table", { id: "updates", class: "grid" },
      el("thead", {}, el("tr", {}, ...["call", "at", "duration", "status", "version after"].map((h) => el("th", { text: h })))),
      el("tbody", {}, ...n.weight_updates.map((u) => el("tr", {},
        el("td", { text: u.kind }), el("td", { text: when(u.started_at) }), el("td", { class: "n", text: u.duration_s.toFixed(3) + " s" }),
        el("td", { class: "n", text: u.status }), el("td", { text: u.version === null ? "—" : "v" + u.version })))));
    const facts = el("dl", { id: "facts" },
      ...[["version", "v" + n.version], ["paused", n.paused ? "yes, since " + when(n.paused_since) : "no"], ["engine kind", n.kind],
        ["routing", n.routing], ["turns in flight", n.in_flight], ["held by a pause", n.held],
        ["waiting for admission", n.admission_waiting ?? "—"], ["owed recomputes (turns)", n.owed_recompute_turns],
        ["sessions", `${n.store.sessions} (${n.store.sessions_open} open, ${n.store.rewards_pending} rewarded, waiting)`],
        ["turns / tokens", `${n.store.turns} / ${n.store.tokens}`]]
        .flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { "data-fact": k, text: String(v) })]));
    $("#main").replaceChildren(el("h2", { text: "Now" }), facts, el("h3", { text: "Engines" }), engines,
      el("h3", { text: "Last weight updates and pauses" }), updates,
      n.weight_updates.length ? null : el("p", { class: "empty", text: "none since this proxy started" }));
  };
  await draw();
  timer = setInterval(() => guarded(draw), 2000);
}

takeTokenFromHash();
window.addEventListener("hashchange", route);
route();
