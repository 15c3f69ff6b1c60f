"""The viewer in a real headless Chromium against a real proxy and reference engine (conftest).

Expected values come from the proxy's session API (``GET /v1/sessions``) and the model's own
tokenizer, never from the viewer's endpoints: the table's rows and order, the turn tree's
edges, the text of every token, the colour of every strip cell, the figures on hover.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from tests.proxy.ui.conftest import ARTIFACTS, AUTH, wait_ready

pytestmark = pytest.mark.slow

PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f", "#bab0ac"]
IMAGE_PAD = 151655


def _rgb(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[k : k + 2], 16) for k in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


def _session(proxy, sid: str) -> dict:
    r = httpx.get(f"{proxy.url}/v1/sessions/{sid}", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _all_sessions(proxy) -> list[dict]:
    r = httpx.get(f"{proxy.url}/v1/sessions", params={"limit": 1000}, headers=AUTH, timeout=60)
    return r.json()["data"]


def _open(driver, proxy, fragment: str) -> None:
    driver.get(f"{proxy.url}/ui/#{fragment}")
    wait_ready(driver)


def _rows(driver) -> list[str]:
    return [tr.get_attribute("data-session") for tr in driver.find_elements(By.CSS_SELECTOR, "#sessions-table tbody tr[data-session]")]


def _filter(driver, **values) -> list[str]:
    form = driver.find_element(By.ID, "filters")
    for name in ("q", "group", "version_min", "version_max", "limit"):
        box = form.find_element(By.NAME, name)
        box.clear()
        if name in values:
            box.send_keys(str(values[name]))
    for name in ("role", "rewarded", "fork_reason", "has_images", "engine"):
        Select(form.find_element(By.NAME, name)).select_by_value(str(values.get(name, "")))
    driver.execute_script("document.body.dataset.ready = ''")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait_ready(driver)
    return _rows(driver)


@pytest.fixture(scope="module")
def signed_in(browser, recorded):
    """The page was opened once with the token in its address (kept for the tab only)."""
    proxy = recorded["proxy"]
    browser.get(f"{proxy.url}/ui/#/?token=adm")
    wait_ready(browser)
    assert "token" not in browser.current_url  # taken out of the address bar
    return browser


def test_the_sessions_table_filters_and_pages(signed_in, recorded):
    driver, proxy = signed_in, recorded["proxy"]
    main, others, group = recorded["main"], recorded["others"], recorded["group"]
    ref = _all_sessions(proxy)
    newest_first = [s["session_id"] for s in sorted(ref, key=lambda s: s["created_at"], reverse=True)]
    _open(driver, proxy, "/")
    assert _rows(driver) == newest_first
    row = driver.find_element(By.CSS_SELECTOR, f'tr[data-session="{main}"]').find_elements(By.TAG_NAME, "td")
    main_ref = _session(proxy, main)
    assert row[2].text == "main"  # roles
    assert int(row[3].text) == len(main_ref["turns"])
    assert int(row[4].text) == sum(len(t["output_ids"]) for t in main_ref["turns"])
    assert int(row[7].text) == sum(1 for t in main_ref["turns"] if t["fork_reason"])
    assert row[9].text == "yes"  # has images

    assert set(_filter(driver, group=group)) == set(others[:3])
    rewarded = {s["session_id"] for s in ref if s["reward"] is not None}
    assert set(_filter(driver, rewarded="true")) == rewarded == set(others[:3])
    assert set(_filter(driver, rewarded="false")) == {s["session_id"] for s in ref} - rewarded
    assert _filter(driver, fork_reason="tools_changed") == [main]
    assert _filter(driver, fork_reason="*") == [main]
    assert _filter(driver, has_images="true") == [main]
    assert main not in _filter(driver, has_images="false")
    # version 0 tokens exist only in turn 0 of the main session (the update came mid-turn)
    assert _filter(driver, version_max=0) == [main]
    assert set(_filter(driver, version_min=1)) == {s["session_id"] for s in ref}
    assert _filter(driver, version_min=2) == []
    assert _filter(driver, q=main[:10]) == [main]

    # pages of two, newest first, through "older" and back through "newer"
    seen = [_filter(driver, limit=2)]
    while driver.find_element(By.ID, "next").is_enabled():
        driver.execute_script("document.body.dataset.ready = ''")
        driver.find_element(By.ID, "next").click()
        wait_ready(driver)
        seen.append(_rows(driver))
    assert [len(p) for p in seen] == [2] * (len(ref) // 2) + ([len(ref) % 2] if len(ref) % 2 else [])
    assert [sid for p in seen for sid in p] == newest_first
    driver.execute_script("document.body.dataset.ready = ''")
    driver.find_element(By.ID, "prev").click()
    wait_ready(driver)
    assert _rows(driver) == seen[-2]


def test_one_session_shows_its_tree_text_image_and_coloured_strip(signed_in, recorded):
    from tokenization import load_tokenizer

    driver, proxy, main = signed_in, recorded["proxy"], recorded["main"]
    ref = _session(proxy, main)
    t0, t1, t2 = ref["turns"]
    assert t1["spliced"] and t2["fork_reason"] == "tools_changed"  # what the session holds
    versions = t0["versions"]
    k = versions.index(1)
    assert 0 < k < len(versions) and set(versions[:k]) == {0} and set(versions[k:]) == {1}  # an abort-resume mid-turn
    _open(driver, proxy, f"/s/{main}")

    # the tree: turn 1 hangs off turn 0 as a spliced edge; turn 2 is a fork with its reason
    li = {t["index"]: driver.find_element(By.CSS_SELECTOR, f'#tree li[data-turn-id="{t["turn_id"]}"]') for t in ref["turns"]}
    assert "edge-spliced" in li[1].get_attribute("class")
    assert "edge-fork" in li[2].get_attribute("class") and "fork: tools_changed" in li[2].text
    parent_of = lambda node: node.find_element(By.XPATH, "./ancestor::li[1]").get_attribute("data-turn-id")  # noqa: E731
    assert parent_of(li[1]) == t1["parent_turn_id"] == t0["turn_id"]
    if t2["parent_turn_id"]:
        assert parent_of(li[2]) == t2["parent_turn_id"]

    # two samples: turns 0 and 1 spliced into one, the fork's own
    sections = driver.find_elements(By.CSS_SELECTOR, "section.sample")
    assert len(sections) == 2
    ids0 = t1["prompt_ids"] + t1["output_ids"]
    assert ids0[: len(t0["prompt_ids"]) + len(t0["output_ids"])] == t0["prompt_ids"] + t0["output_ids"]
    cells = sections[0].find_elements(By.CSS_SELECTOR, ".strip .c")
    assert len(cells) == len(ids0)

    # the text: every token's own decoded text, in order; the image's placeholders are one picture
    tok = load_tokenizer(str(recorded["vl_dir"]))
    spans = sections[0].find_elements(By.CSS_SELECTOR, ".text .t")
    texts = driver.execute_script("return arguments[0].map(s => s.textContent)", spans)
    expected = [
        "" if i == IMAGE_PAD else tok.decode([i], skip_special_tokens=False)
        for n, i in enumerate(ids0)
        if not (i == IMAGE_PAD and n and ids0[n - 1] == IMAGE_PAD)
    ]
    assert texts == expected
    (img,) = sections[0].find_elements(By.CSS_SELECTOR, "img.inline-img")
    assert img.get_attribute("data-hash") == t0["images"][0]["hash"]
    driver.execute_script("return new Promise(r => { const i = arguments[0]; if (i.complete && i.naturalWidth) r(); else i.onload = r; })", img)
    assert driver.execute_script("return [arguments[0].naturalWidth, arguments[0].naturalHeight]", img) == [96, 64]
    # reasoning and the tool call are set apart
    seg = lambda n: "".join(driver.execute_script(  # noqa: E731
        "return arguments[0].map(s => s.textContent)", sections[0].find_elements(By.CSS_SELECTOR, f".text .seg-{n}")))
    assert "The screen shows a form" in seg(1)
    assert '"name": "click"' in seg(2)

    # the strip coloured by version: turn 0's output changes colour where the weights changed
    n0 = len(t0["prompt_ids"])
    colours = driver.execute_script("return arguments[0].map(c => getComputedStyle(c).backgroundColor)", cells)
    assert colours[n0 : n0 + len(versions)] == [_rgb(PALETTE[v]) for v in versions]
    assert colours[0] == "rgb(217, 217, 217)"  # context: no version
    # the whole-sample overview above the strip (one bucket per token at this size) agrees
    canvas = sections[0].find_element(By.CSS_SELECTOR, "canvas.overview")
    probe = [n0, n0 + len(versions) - 1, 0]
    pixels = driver.execute_script(
        "const [c, n, idx] = arguments; const ctx = c.getContext('2d');"
        "return idx.map(i => Array.from(ctx.getImageData(Math.floor((i + 0.5) * c.width / n), 7, 1, 1).data.slice(0, 3)));",
        canvas, len(ids0), probe)  # fmt: skip
    as_rgb = lambda p: f"rgb({p[0]}, {p[1]}, {p[2]})"  # noqa: E731
    assert [as_rgb(p) for p in pixels] == [_rgb(PALETTE[versions[0]]), _rgb(PALETTE[versions[-1]]), "rgb(217, 217, 217)"]
    # by loss mask: sampled tokens of turns 0 and 1 are trained on, the rest are not
    Select(driver.find_element(By.ID, "channel")).select_by_value("mask")
    colours = driver.execute_script("return arguments[0].map(c => getComputedStyle(c).backgroundColor)", cells)
    n1 = len(t1["prompt_ids"])
    trained = {*range(n0, n0 + len(t0["output_ids"])), *range(n1, n1 + len(t1["output_ids"]))}
    assert [c == _rgb("#59a14f") for c in colours] == [i in trained for i in range(len(ids0))]

    # hover: a version-0 token sampled before the update shows its id, version, behaviour and
    # proximal value (recomputed under version 1 at the resume)
    j = max(0, k - 2)
    ActionChains(driver).move_to_element(cells[n0 + j]).perform()
    tip = driver.find_element(By.ID, "tip")
    assert tip.is_displayed()
    text = tip.text
    assert f"id {t0['output_ids'][j]}" in text
    assert f"version {versions[j]}" in text
    assert f"behaviour {t0['output_logprobs'][j]:.6f}" in text
    assert f"proximal {t0['proximal_logprobs_t'][j]:.6f} (v{t0['proximal_versions'][j]})" in text
    assert t0["proximal_versions"][j] == 1 and t0["proximal_logprobs_t"][j] != t0["output_logprobs"][j]

    # the samples table and the reward line
    assert len(driver.find_elements(By.CSS_SELECTOR, "#samples tbody tr")) == 2
    assert driver.find_element(By.ID, "reward").text == "none yet"
    Select(driver.find_element(By.ID, "channel")).select_by_value("version")
    ActionChains(driver).move_to_element(cells[n0 + k - 1]).perform()  # the last token sampled by v0
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "viewer-session.png"))
    assert (ARTIFACTS / "viewer-session.png").stat().st_size > 10_000


_NOW_SNAPSHOT = """
const cells = (sel) => [...document.querySelectorAll(sel)].map((tr) => [...tr.cells].map((td) => td.textContent.trim()));
const facts = Object.fromEntries([...document.querySelectorAll('dd[data-fact]')].map((d) => [d.dataset.fact, d.textContent.trim()]));
return {facts, engines: cells('#engines tbody tr'), updates: cells('#updates tbody tr')};
"""


def test_the_now_page_shows_engines_versions_and_the_weight_update(signed_in, recorded):
    driver, proxy = signed_in, recorded["proxy"]
    status = httpx.get(f"{proxy.url}/admin/status", headers=AUTH, timeout=30).json()
    _open(driver, proxy, "/now")
    # The page redraws every 2 s: read it in one script so no element goes stale between reads.
    now = driver.execute_script(_NOW_SNAPSHOT)
    fact = now["facts"]
    assert fact["version"] == f"v{status['version']}" == "v1"
    assert fact["paused"] == "no"
    assert fact["owed recomputes (turns)"] == str(status["owed_recompute_turns"])
    rows = now["engines"]
    assert len(rows) == len(status["engines"]["engine_replicas"]) == 1
    assert rows[0][3] == "v1"
    calls = now["updates"]
    kinds = [c[0] for c in calls]
    assert kinds[:3] == ["resume", "update_weights", "pause"]  # newest first
    update = calls[1]
    assert update[3] == "200" and update[4] == "v1" and re.fullmatch(r"\d+\.\d{3} s", update[2])


def test_the_pages_request_nothing_but_the_proxy(signed_in, recorded):
    driver, proxy = signed_in, recorded["proxy"]
    driver.get_log("performance")  # drop what earlier tests logged
    for fragment in ("/", f"/s/{recorded['main']}", "/now"):
        _open(driver, proxy, fragment)
    urls = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    assert any(u.startswith(proxy.url + "/ui/api/") for u in urls)
    foreign = [u for u in urls if not (u.startswith(proxy.url + "/") or u.startswith(("data:", "blob:")))]
    assert foreign == []
    resources = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(u.startswith(proxy.url + "/") or u.startswith(("data:", "blob:")) for u in resources)


def _roles_of(proxy, sid: str) -> set[str]:
    return {t["role"] for t in _session(proxy, sid)["turns"]}


def _next_page(driver) -> list[str]:
    driver.execute_script("document.body.dataset.ready = ''")
    driver.find_element(By.ID, "next").click()
    wait_ready(driver)
    return _rows(driver)


def test_the_role_filter_filters_and_pages(signed_in, recorded):
    driver, proxy = signed_in, recorded["proxy"]
    episode, subagent = recorded["episode"], recorded["subagent"]
    ref = sorted(_all_sessions(proxy), key=lambda s: s["created_at"], reverse=True)
    roles = {s["session_id"]: _roles_of(proxy, s["session_id"]) for s in ref}
    assert roles[episode] == {"main", "auxiliary"} and roles[subagent] == {"subagent", "auxiliary"}
    holding = lambda role: [s["session_id"] for s in ref if role in roles[s["session_id"]]]  # noqa: E731
    _open(driver, proxy, "/")
    for role in ("main", "auxiliary", "subagent", "compacted"):
        assert _filter(driver, role=role) == holding(role), role
    assert _filter(driver, role="auxiliary") == [subagent, episode]
    assert subagent not in _filter(driver, role="main")
    # one per page: the side-call sessions, newest first, then no further page
    assert _filter(driver, role="auxiliary", limit=1) == [subagent]
    assert _next_page(driver) == [episode]
    assert not driver.find_element(By.ID, "next").is_enabled()
    # with another filter: the rewarded group has no side calls
    assert _filter(driver, role="auxiliary", rewarded="true") == []
    # the filter is in the address, and the roles column shows each session's roles, main first
    _filter(driver, role="auxiliary")
    assert "role=auxiliary" in driver.current_url
    badges = lambda sid: [b.text for b in driver.find_elements(By.CSS_SELECTOR, f'tr[data-session="{sid}"] td.roles .role')]  # noqa: E731
    assert badges(episode) == ["main", "auxiliary"]
    assert badges(subagent) == ["auxiliary", "subagent"]
    driver.get(f"{proxy.url}/ui/#/?role=subagent")
    wait_ready(driver)
    assert _rows(driver) == [subagent]


def test_a_session_with_a_side_call_shows_each_turns_role_in_its_tree(signed_in, recorded):
    from tests.proxy.ui.conftest import TITLE_REQUEST

    driver, proxy = signed_in, recorded["proxy"]
    for sid, kinds in ((recorded["episode"], ("main", "auxiliary")), (recorded["subagent"], ("subagent", "auxiliary"))):
        ref = _session(proxy, sid)["turns"]
        assert tuple(t["role"] for t in ref) == kinds
        _open(driver, proxy, f"/s/{sid}")
        li = [driver.find_element(By.CSS_SELECTOR, f'#tree li[data-turn-id="{t["turn_id"]}"]') for t in ref]
        for node, t in zip(li, ref):
            assert node.get_attribute("data-role") == t["role"]
            assert node.find_element(By.CSS_SELECTOR, ".turn-link .role").text == t["role"]
        # the side call is set apart from the conversation it belongs to
        assert "aux" in li[1].get_attribute("class").split()
        style = lambda e: driver.execute_script(  # noqa: E731
            "const s = getComputedStyle(arguments[0]); return [s.backgroundColor, s.borderLeftStyle]", e)
        assert style(li[1]) != style(li[0])
        ink = lambda e: driver.execute_script("return getComputedStyle(arguments[0]).color", e)  # noqa: E731
        main_ink = ink(driver.find_element(By.CSS_SELECTOR, "header#top + form, #main h2"))
        assert ink(li[0]) == ink(li[1]) == main_ink  # the tree's text stays as readable as the page's
        # its tokens are shown in a sample of its own, marked as one a pull leaves out
        rows = [[td.text for td in tr.find_elements(By.TAG_NAME, "td")] for tr in driver.find_elements(By.CSS_SELECTOR, "#samples tbody tr")]
        assert [(r[1], r[-1]) for r in rows] == [(kinds[0], "yes"), ("auxiliary", "no")]
        sections = driver.find_elements(By.CSS_SELECTOR, "section.sample")
        text = "".join(driver.execute_script("return arguments[0].map(s => s.textContent)",
                                             sections[1].find_elements(By.CSS_SELECTOR, ".text .t")))  # fmt: skip
        assert TITLE_REQUEST in text
        head = sections[1].find_element(By.CSS_SELECTOR, ".turn-head")
        assert head.get_attribute("data-turn-id") == ref[1]["turn_id"]
        assert head.find_element(By.CSS_SELECTOR, ".role").text == "auxiliary"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "viewer-roles.png"))
