"""The web console at `GET /` in a real browser: Debian's `chromium` driven headless by `chromium-driver`
through selenium, against the embedded P/D deployment (examples/pd.yaml) and a colocated server with an
API key.

Chromium missing is a failure that says how to install it, never a skip: scripts/test.sh installs both
packages when they are absent. Each browser test saves a screenshot under target/test-artifacts/
(`console-pd.png`, `console-key.png`) for a person to look at; CI keeps the folder with the target dir.
"""

import json
import pathlib
import shutil

import pytest
import requests

from conftest import API_KEY, MODEL_NAME, ROOT

ARTIFACTS = ROOT / "target" / "test-artifacts"
WAIT_S = 60
INSTALL_HINT = (
    "the console tests need Debian's chromium and chromium-driver: "
    "`sudo apt-get install -y chromium chromium-driver` (scripts/test.sh installs them when missing)"
)


def browser():
    """A headless Chromium that keeps the page's console log."""
    chromium = shutil.which("chromium")
    chromedriver = shutil.which("chromedriver")
    if not chromium or not chromedriver:
        pytest.fail(INSTALL_HINT)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is missing: pip install -r tests/python/requirements.txt")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)


@pytest.fixture
def driver():
    d = browser()
    yield d
    d.quit()


def wait_for(driver, what, condition, timeout=WAIT_S, poll=0.2):
    """Waits until condition(driver) is truthy and returns it; fails naming what it waited for."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=poll).until(condition)
    except TimeoutException:
        shot = save_screenshot(driver, "console-timeout.png")
        pytest.fail(f"timed out after {timeout}s waiting for {what}; screenshot: {shot}")


def save_screenshot(driver, name) -> pathlib.Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    return path


def text_of(driver, css):
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, css)
    return found[-1].text if found else ""


def severe_logs(driver, allowed=()):
    """SEVERE entries of the page's console log, but those containing one of `allowed`."""
    return [
        e for e in driver.get_log("browser")
        if e["level"] == "SEVERE" and not any(a in e["message"] for a in allowed)
    ]


def type_and_enter(driver, text):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element(By.ID, "chat-input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def set_field(driver, element_id, value):
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(str(value))


def answer_done(driver):
    """The last answer's stats once it finished (the stats line names its finish reason)."""
    stats = text_of(driver, ".msg.assistant .stats")
    return stats if "finish:" in stats else None


def test_page_and_assets_are_served_without_the_key_with_a_strict_policy(auth_server):
    page = requests.get(auth_server.url + "/", timeout=10)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    for asset, kind in (("/console/console.js", "text/javascript"), ("/console/console.css", "text/css")):
        r = requests.get(auth_server.url + asset, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), asset
        assert asset in page.text
    # The data behind the page keeps the API's key.
    assert requests.get(auth_server.url + "/v1/cluster", timeout=10).status_code == 401


def test_cluster_snapshot_of_pd_reports_roles_routing_kv_and_latency(pd_server):
    r = requests.post(pd_server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Describe a lighthouse at night in a few sentences. " * 3}],
        "max_tokens": 8,
        "temperature": 0,
    })
    assert r.status_code == 200, r.text
    view = requests.get(pd_server.url + "/v1/cluster", timeout=10).json()
    assert view["model"] == MODEL_NAME
    assert sorted(w["role"] for w in view["workers"]) == ["decode", "prefill"]
    for w in view["workers"]:
        assert w["address"].startswith("http://") and w["healthy"] and not w["draining"]
        assert w["kv_blocks_total"] > 0
    assert view["routing"]["remote"] >= 1, view["routing"]
    assert view["kv_bytes_moved"] > 0
    ttft = view["latency"]["ttft"]
    assert ttft["count"] >= 1 and ttft["sum"] > 0
    assert ttft["buckets"][-1][1] <= ttft["count"]
    assert [b[0] for b in ttft["buckets"]] == sorted(b[0] for b in ttft["buckets"])
    assert view["latency"]["itl"]["count"] >= 1
    assert view["latency"]["e2e"]["count"] >= 1


def test_console_against_pd_shows_workers_and_streams_an_answer(pd_server, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.get(pd_server.url + "/")
    wait_for(driver, "the model name", lambda d: d.find_element(By.ID, "model-name").text == MODEL_NAME)
    roles = wait_for(driver, "a prefill and a decode worker", lambda d: sorted(
        row.get_attribute("data-role") for row in d.find_elements(By.CSS_SELECTOR, "#workers tbody tr")
    ) == ["decode", "prefill"] and d.find_elements(By.CSS_SELECTOR, "#workers tbody tr"))
    table = driver.find_element(By.ID, "workers").text
    assert "prefill" in table and "decode" in table and "healthy" in table, table
    assert len(roles) == 2

    # Shift+Enter is a new line, not a send.
    box = driver.find_element(By.ID, "chat-input")
    box.send_keys("first line")
    box.send_keys(Keys.SHIFT, Keys.ENTER)
    assert box.get_attribute("value") == "first line\n"
    assert not driver.find_elements(By.CSS_SELECTOR, ".msg")
    box.clear()

    set_field(driver, "temperature", 0)
    set_field(driver, "max-tokens", 32)
    set_field(driver, "system", "You are a helpful assistant.")
    type_and_enter(driver, "Write one sentence about the sea.")
    stats = wait_for(driver, "the streamed answer to finish", answer_done)
    answer = text_of(driver, ".msg.assistant .content")
    assert answer.strip(), "the answer is empty"
    assert "Error" not in answer, answer
    assert "TTFT" in stats and " ms" in stats and "tokens" in stats, stats
    assert text_of(driver, ".msg.user .content") == "Write one sentence about the sea."

    # The next polls see the request: routed, its KV moved, its latency charted.
    wait_for(driver, "the routing card to count the request", lambda d: sum(
        int(x) for x in d.find_element(By.ID, "routing").text.split(" / ")
    ) >= 1)
    wait_for(driver, "a TTFT point on the chart", lambda d: d.execute_script(
        "return series.ttftMean.some((p) => p.v !== null && p.v > 0)"))
    assert driver.find_element(By.ID, "kv-moved").text not in ("–", "0 B")
    shot = save_screenshot(driver, "console-pd.png")
    assert shot.stat().st_size > 10_000

    # Stop aborts a long answer mid-stream (a fresh chat, so the first answer does not shape this one).
    driver.find_element(By.ID, "clear").click()
    set_field(driver, "max-tokens", 400)
    type_and_enter(driver, "Write a long story about a dragon who learns to sail, with many chapters.")
    wait_for(driver, "the first token of the long answer",
             lambda d: "TTFT" in text_of(d, ".msg.assistant .stats"), poll=0.05)
    driver.find_element(By.ID, "stop").click()
    stats = wait_for(driver, "the stopped answer", answer_done)
    assert "finish: stopped" in stats, stats
    assert len(driver.find_elements(By.CSS_SELECTOR, ".msg")) == 2, "Clear chat left earlier messages"
    assert driver.find_element(By.ID, "send").is_enabled()
    assert severe_logs(driver) == []


def test_console_asks_for_the_key_and_works_colocated(auth_server, driver):
    from selenium.webdriver.common.by import By

    driver.get(auth_server.url + "/")
    wait_for(driver, "the key form", lambda d: d.find_element(By.ID, "key-form").is_displayed())
    assert "API key" in driver.find_element(By.ID, "status").text
    driver.find_element(By.ID, "key-input").send_keys(API_KEY)
    driver.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()
    wait_for(driver, "the colocated worker", lambda d: [
        row.get_attribute("data-role") for row in d.find_elements(By.CSS_SELECTOR, "#workers tbody tr")
    ] == ["colocated"])
    assert driver.find_element(By.ID, "model-name").text == MODEL_NAME
    assert driver.execute_script("return sessionStorage.getItem('tandem.apiKey')") == API_KEY

    set_field(driver, "temperature", 0)
    set_field(driver, "max-tokens", 12)
    type_and_enter(driver, "Say hello.")
    stats = wait_for(driver, "the streamed answer to finish", answer_done)
    assert text_of(driver, ".msg.assistant .content").strip()
    assert "TTFT" in stats, stats
    wait_for(driver, "the routing card to count the local prefill", lambda d: int(
        d.find_element(By.ID, "routing").text.split(" / ")[1]
    ) >= 1)
    save_screenshot(driver, "console-key.png")
    # Only the expected refusals before the key was entered.
    assert severe_logs(driver, allowed=("401",)) == []


# A reasoning model's stream as the server sends it (tests/python/test_reasoning.py checks that the server
# splits `<think>` this way): thinking in `reasoning_content` deltas, then the answer in `content`.
REASONING_STREAM = [
    {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "The user greets me. "}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "I greet back."}}]},
    {"choices": [{"index": 0, "delta": {"content": "Hello"}}]},
    {"choices": [{"index": 0, "delta": {"content": " there!"}, "finish_reason": "stop"}]},
]

# Answers the page's chat requests with REASONING_STREAM and keeps their bodies in window.sentBodies;
# every other request reaches the server.
FAKE_CHAT = """
const events = arguments[0];
window.sentBodies = [];
const realFetch = window.fetch.bind(window);
window.fetch = async (url, init) => {
  if (!String(url).endsWith("/v1/chat/completions")) return realFetch(url, init);
  window.sentBodies.push(JSON.parse(init.body));
  const sse = events.map((e) => "data: " + JSON.stringify(e) + "\\n\\n").join("") + "data: [DONE]\\n\\n";
  return new Response(sse, { status: 200, headers: { "Content-Type": "text/event-stream" } });
};
"""


def test_console_shows_a_reasoning_models_thinking_apart_and_never_sends_it_back(server, driver):
    from selenium.webdriver.common.by import By

    driver.get(server.url + "/")
    wait_for(driver, "the model name", lambda d: d.find_element(By.ID, "model-name").text == MODEL_NAME)
    driver.execute_script(FAKE_CHAT, REASONING_STREAM)
    type_and_enter(driver, "Hi!")
    wait_for(driver, "the answer to finish", answer_done)
    assert text_of(driver, ".msg.assistant > .content") == "Hello there!"
    thinking = driver.find_element(By.CSS_SELECTOR, ".msg.assistant details.thinking")
    assert thinking.find_element(By.CSS_SELECTOR, ".content").text == "The user greets me. I greet back."
    assert thinking.find_element(By.TAG_NAME, "summary").text == "thinking"
    # The next turn sends the conversation back with the answer only, as reasoning models expect.
    type_and_enter(driver, "Again?")
    wait_for(driver, "the second answer", lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
             == 2 and "finish:" in text_of(d, ".msg.assistant .stats"))
    sent = driver.execute_script("return window.sentBodies")
    assert [m["role"] for m in sent[1]["messages"]][-3:] == ["user", "assistant", "user"]
    assert sent[1]["messages"][-2]["content"] == "Hello there!"
    assert all("reasoning" not in json.dumps(m) and "greet back" not in json.dumps(m) for m in sent[1]["messages"])
    save_screenshot(driver, "console-thinking.png")
    assert severe_logs(driver) == []
