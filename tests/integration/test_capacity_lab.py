"""The dashboard's Capacity lab, served by the real app and played in a real headless Chromium.

The browser is driven over the DevTools protocol (``chromium_cdp``): controls are typed into
and buttons clicked with real mouse events, then the page's DOM is read. Screenshots are kept
under the test's tmp dir (with BACKFILL_CAPACITY_LAB_PNG set, the KV one is copied there: that
is how docs/capacity-lab.png is made).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest
from batch_api_support import LiveServer
from chromium_cdp import CHROMIUM, Chromium


def test_the_lab_is_linked_from_the_dashboards_navigation(server: LiveServer) -> None:
    home = httpx.get(f"{server.base_url}/dashboard/", timeout=10)
    assert 'href="lab.html"' in home.text
    page = httpx.get(f"{server.base_url}/dashboard/lab.html", timeout=10)
    assert page.status_code == 200
    assert "Capacity lab" in page.text
    for asset in ("lab.js", "lab.css"):
        assert httpx.get(f"{server.base_url}/dashboard/{asset}", timeout=10).status_code == 200


def test_the_lab_endpoints_need_no_key_and_compute_both_worlds(server: LiveServer) -> None:
    lru = httpx.post(f"{server.base_url}/lab/lru", json={"capacity_slots": 3}, timeout=10)
    assert lru.status_code == 200
    assert lru.json()["hits"] == 0
    assert len(lru.json()["steps"]) == 16
    kv = httpx.post(
        f"{server.base_url}/lab/kv",
        json={"capacity_slots": 3, "working_set": 4, "interactive_every": 4},
        timeout=10,
    ).json()
    assert kv["hits"] == 10
    assert kv["interactive"] == [4]
    preempt = kv["steps"][3]["events"][0]
    assert (preempt["kind"], preempt["identifier"], preempt["generated"]) == ("preempt", 3, 1)
    assert "preempting 1 batch lease" in kv["steps"][3]["reason"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/lab/lru", {"requests": 4097}),
        ("/lab/kv", {"capacity_slots": 0}),
        ("/lab/kv", {"capacity_slots": 2, "reserve_slots": 3}),
    ],
)
def test_the_lab_refuses_controls_out_of_range(
    server: LiveServer, path: str, body: dict[str, int]
) -> None:
    answer = httpx.post(f"{server.base_url}{path}", json=body, timeout=10)
    assert answer.status_code in (400, 422)
    assert answer.json()["error"]["message"]


def _play(browser: Chromium, capacity: int, working_set: int, prediction: int) -> int:
    browser.type_into("#capacity", str(capacity))
    browser.type_into("#working-set", str(working_set))
    browser.type_into("#requests", "16")
    browser.type_into("#prediction", str(prediction))
    browser.click("#reset")
    browser.wait_for(
        "document.querySelector('#run').dataset.position === '0'"
        f" && document.querySelector('[data-slot=\"{capacity - 1}\"]') !== null"
        f" && document.querySelector('[data-slot=\"{capacity}\"]') === null"
    )
    browser.click("#play")
    browser.wait_for("document.querySelector('#run').dataset.done === 'true'")
    assert browser.evaluate("document.querySelector('#run').dataset.position") == "16"
    return int(browser.evaluate("document.querySelector('#run').dataset.hits"))


@pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (scripts/test.sh installs it)"
)
def test_in_chromium_a_working_set_fits_four_slots_and_thrashes_three(
    server: LiveServer, tmp_path: Path
) -> None:
    with Chromium(tmp_path / "profile", height=1100) as browser:
        browser.open(f"{server.base_url}/dashboard/lab.html")
        browser.wait_for("document.querySelector('#counters').textContent.includes('of 16')")

        assert _play(browser, 4, 4, prediction=12) == 12
        assert browser.text("[data-counter='hits'] b") == "12"
        assert "your prediction held" in browser.text("#verdict")

        assert _play(browser, 3, 4, prediction=12) == 0
        assert browser.text("[data-counter='hits'] b") == "0"
        assert "it did not hold" in browser.text("#verdict")
        assert browser.evaluate("document.querySelectorAll('#timeline .cell.miss').length") == 16
        lru_shot = tmp_path / "capacity-lab-lru.png"
        browser.screenshot(lru_shot)

        # The same stream and capacity as KV reservations: sequence 4 is interactive.
        browser.click("input[name='mode'][value='kv']")
        browser.type_into("#interactive-every", "4")
        hits = _play(browser, 3, 4, prediction=0)
        assert hits == 10  # deferral instead of thrashing: the admitted three keep running
        assert browser.text("[data-counter='preempted'] b") == "1"
        assert browser.text("[data-counter='resumed'] b") == "1"
        assert browser.evaluate("document.querySelectorAll('#timeline .cell.defer').length") == 2
        # Step back through the start: the preemption at request 4 is on the page.
        browser.click("#reset")
        browser.wait_for("document.querySelector('#run').dataset.position === '0'")
        for _ in range(4):
            browser.click("#step")
        browser.wait_for("document.querySelector('#run').dataset.position === '4'")
        events = browser.text("#events")
        assert "sequence 3 (batch) preempted" in events
        assert "keeps its 1 output token" in events
        assert "preempting 1 batch lease" in browser.text("#reason")
        assert browser.text("#queue") == "3"
        for _ in range(9):
            browser.click("#step")
        browser.wait_for("document.querySelector('#run').dataset.position === '13'")
        assert "sequence 3 (batch) resumed" in browser.text("#events")
        kv_shot = tmp_path / "capacity-lab.png"
        browser.screenshot(kv_shot)

    for shot in (lru_shot, kv_shot):
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert shot.stat().st_size > 20_000
    keep = os.environ.get("BACKFILL_CAPACITY_LAB_PNG")
    if keep:
        shutil.copyfile(kv_shot, keep)
