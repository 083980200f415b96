"""The dashboard in a real browser (headless Chromium through Selenium) against a live server
on the default model under load: the page loads with no console errors, its charts and
waterfall update, and the numbers it shows equal /metrics. The API key is set, so the page must
send it (taken from the URL fragment).

The screenshot is written to this test's pytest tmp dir; the path is printed (pytest -s) and
kept in the test report's captured output.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from live_server import MODEL, LiveServer

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
KEY = "dash-secret"

pytestmark = pytest.mark.timeout(300)


def _browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extra")
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip(f"no browser: {CHROMIUM} / {CHROMEDRIVER} missing (make test installs "
                    "Debian's chromium and chromium-driver with apt-get, as root)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1300"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


@pytest.fixture(scope="module")
def server(default_model_path):
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine

    engine = build_engine(EngineArgs(model=MODEL, kv_cache_memory=64 * 2**20, max_num_seqs=16,
                                     enable_prefix_caching=True))
    s = LiveServer(engine, api_key=KEY, slo_ttft_ms=400, slo_tpot_ms=60)
    yield s
    s.stop()


class Load:
    """Streams of a few prompts (one shared prefix) from a few threads until stopped."""

    def __init__(self, server: LiveServer, num_threads: int = 3):
        self.server = server
        self.stop = threading.Event()
        self.num_done = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(num_threads)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        prefix = "You are a concise assistant. Answer in one sentence. " * 8
        with self.server.client() as c:
            j = 0
            while not self.stop.is_set():
                j += 1
                body = {"model": MODEL, "prompt": f"{prefix} Question {i}.{j}: name a colour.",
                        "max_tokens": 12 + 4 * (j % 3), "stream": j % 2 == 0,
                        "ignore_eos": True}
                try:
                    r = c.post("/v1/completions", json=body)
                    r.read()
                    if r.status_code != 200:
                        self.errors.append(f"{r.status_code} {r.text[:200]}")
                    self.num_done += 1
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _shown(driver) -> dict[str, str]:
    return driver.execute_script(
        "const o = {}; document.querySelectorAll('.tile .v').forEach("
        "e => o[e.dataset.key] = e.dataset.raw); return o;")


def test_dashboard_live_in_browser(server, tmp_path):
    # Without the key the data is refused while the page itself loads.
    assert httpx.get(server.url + "/dashboard/data").status_code == 401
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and "<canvas" in page.text and "http" not in \
        page.text.split("<body>")[1].split("dashboard/dashboard.js")[0].lower()
    load = Load(server)
    driver = _browser()
    try:
        driver.get(f"{server.url}/dashboard?interval=300&window=120#key={KEY}")
        _wait(lambda: load.num_done >= 4, 120, "the first requests")
        state = lambda: driver.execute_script("return window.servelmDashboard")
        _wait(lambda: state()["polls"] >= 3, 60, "the page's first polls")
        assert "#key" not in driver.current_url  # the key left the address bar
        points = int(driver.find_element("id", "c-requests").get_attribute("data-points"))
        first_tokens = float(_shown(driver)["counters.generation_tokens"])
        _wait(lambda: float(_shown(driver)["counters.generation_tokens"]) > first_tokens, 60,
              "the generated-token count to move on the page")
        later = int(driver.find_element("id", "c-requests").get_attribute("data-points"))
        assert later > points, "the requests chart did not gain points"
        steps = int(driver.find_element("id", "c-steps").get_attribute("data-points"))
        assert steps > 0
        mbu = _shown(driver)["window.bandwidth_util"]
        assert mbu and 0 < float(mbu) < 1.5, mbu  # the cost model's estimate, per step
        rows = int(driver.find_element("id", "waterfall").get_attribute("data-rows"))
        assert rows > 0
        phases = driver.execute_script(
            "return [...document.querySelectorAll('#waterfall rect.phase')]"
            ".map(r => r.dataset.phase)")
        assert {"prefill", "decode"} <= set(phases), phases

        load.finish()
        assert not load.errors, load.errors[:3]
        metrics = server.wait_idle(30)
        polls = state()["polls"]
        _wait(lambda: state()["polls"] >= polls + 2, 30, "polls after the load")
        shown = _shown(driver)
        scraped = server.metrics()
        expect = {
            "gauges.running": "servelm_num_requests_running",
            "gauges.waiting": "servelm_num_requests_waiting",
            "gauges.kv_usage": "servelm_kv_cache_usage_ratio",
            "gauges.prefix_hit_rate": "servelm_prefix_cache_hit_rate",
            "gauges.goodput": "servelm_goodput_ratio",
            "counters.preemptions": "servelm_preemptions_total",
            "counters.generation_tokens": "servelm_generation_tokens_total",
        }
        for key, name in expect.items():
            assert float(shown[key]) == pytest.approx(scraped[name], rel=1e-9, abs=1e-12), \
                (key, shown[key], scraped[name])
        finished = sum(v for k, v in scraped.items()
                       if k.startswith("servelm_requests_finished_total{"))
        assert float(shown["counters.requests_finished"]) == finished > 0
        assert scraped["servelm_prefix_cache_hit_rate"] > 0  # the shared prefix was found
        # The window's TTFT count is every request the histogram saw (window > test length).
        data = state()["last"]
        assert data["window"]["ttft_s"]["count"] == \
            scraped["servelm_time_to_first_token_seconds_count"]
        logs = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not logs, logs
        shot = tmp_path / "dashboard.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        print(f"\ndashboard screenshot: {shot}")
        assert metrics["servelm_num_requests_running"] == 0
    finally:
        load.finish()
        driver.quit()


def test_router_dashboard_in_browser():
    """The router's page over two model-free replicas behind an API key."""
    from servers import Uvicorn, fake_server, metrics

    from servelm.router.app import build_router_app
    from servelm.router.policies import make_policy
    from servelm.router.replicas import ReplicaSet

    replicas = [fake_server(api_key=KEY) for _ in range(2)]
    router = Uvicorn(build_router_app(ReplicaSet([r.url for r in replicas], 0.2),
                                      make_policy("round_robin")))
    auth = {"Authorization": f"Bearer {KEY}"}
    driver = None
    try:
        with httpx.Client(base_url=router.url, headers=auth, timeout=30) as c:
            for i in range(4):
                assert c.post("/v1/completions", json={"model": "fake", "prompt": [9 + i] * 20,
                                                       "max_tokens": 6}).status_code == 200
        driver = _browser()
        driver.get(f"{router.url}/dashboard?interval=300#key={KEY}")
        _wait(lambda: driver.execute_script("return window.servelmDashboard.polls") >= 2, 60,
              "the router page's polls")
        assert driver.find_element("id", "replicas").text == "replicas 2/2 reporting"
        total = sum(metrics(r.url, auth)["servelm_generation_tokens_total"] for r in replicas)
        assert float(_shown(driver)["counters.generation_tokens"]) == total == 24
        rows = int(driver.find_element("id", "waterfall").get_attribute("data-rows"))
        assert rows == 4
        assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        if driver is not None:
            driver.quit()
        router.stop()
        for r in replicas:
            r.stop()
