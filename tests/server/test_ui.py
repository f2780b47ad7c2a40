"""The chat page at ``gemmalite serve``'s root, driven in a real headless Chromium (Debian's
``chromium``, through Playwright's Python package; never a browser that Playwright downloads).

Three live servers: a tiny Gemma 4 with a vision tower, an EmbeddingGemma 2 with its towers and
``--api-key`` (every weight random); and the same model behind a scripted engine whose logits
spell a fixed reply, twice: markup as text (for the escaping test) one slow step at a time (for
the stop test), and a thought, an answer and a tool call in Gemma 4's markup (read apart by the
server's own parser, under its own tools grammar). The oracles are the API's own reply to the
request the page sent, `ChatSession.chat` / `Embedder.embed` on the same models (computed before
the servers serve), and the scripted reply's parts. A screenshot of each state goes to
$GEMMALITE_SCREENSHOTS (or a folder in pytest's tmp dir), named at the end of the run.

Skipped when chromium or playwright is absent, except under CI (CI=true), where that fails."""
from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from live_server import KEY, LiveServer

CHROMIUM = os.environ.get("GEMMALITE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-default-apps", "--mute-audio",
         "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"]  # a beeping microphone
MODEL_ID, EMB_ID = "tiny-vision", "eg2-tiny"
PAYLOAD = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2"> <b>bold</b> &amp; done'
SYSTEM, FIRST, SECOND = "Be brief.", "Hello there", "And then?"
QUESTION = "What is in this picture?"


def _need_browser():
    why = None
    if not Path(CHROMIUM).exists():
        why = f"no chromium at {CHROMIUM} (apt-get install chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            why = "the playwright package is not installed (pip install -e '.[test]')"
    if why and os.environ.get("CI") == "true":
        pytest.fail(f"browser tests need a browser under CI: {why}")
    if why:
        pytest.skip(why)


def _png(h: int, w: int, seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


PICS = {"a": _png(50, 90, 0), "b": _png(120, 40, 1)}


def _wav(n: int = 8000) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, (np.sin(np.arange(n) / 5.0) * 0.5).astype(np.float32), 16000, subtype="PCM_16", format="WAV")
    return buf.getvalue()


HEARD = "What is said?"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}]
WEATHER = "Weather in Paris?"
THOUGHT, ANSWER = "The user wants <b>weather</b>;\ncall the tool.", "Let me check."


# -- a scripted engine: the real one's KV states, logits that spell a fixed reply -----------------
class ScriptedEngine:
    """Every reply is ``script`` (token ids) over and over, whatever the prompt; each decode step
    also sleeps ``delay`` seconds. The real engine still runs, so the KV states the scheduler
    caches and reuses are real ones."""

    def __init__(self, engine, script: list[int], delay: float):
        self.engine, self.script, self.delay = engine, script, delay

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _forced(self, nxt: list[int]) -> np.ndarray:
        out = np.zeros((len(nxt), self.engine.vocab_size), np.float32)
        out[np.arange(len(nxt)), nxt] = 20.0
        return out

    def prefill(self, state, ids, soft=None):
        h = self.engine.prefill(state, ids, soft)
        state.reply_start = state.length
        return h

    def prefill_many(self, states, prompts):
        h = self.engine.prefill_many(states, prompts)
        for s in states:
            s.reply_start = s.length
        return h

    def logits(self, h, each=False):
        return self._forced([self.script[0]] * len(h))

    def decode_batch(self, states, tokens):
        done = [s.length - s.reply_start for s in states]  # reply tokens already in each state
        self.engine.decode_batch(states, tokens)
        time.sleep(self.delay)
        nxt = [self.script[(k + j + 1) % len(self.script)]
               for s, k, t in zip(states, done, tokens) for j in range(len(np.atleast_1d(t)))]
        return self._forced(nxt)


class PlainVocabModel:
    """The model with a tokenizer that lacks Gemma 4's chat markup tokens (as Gemma 3's does)."""

    class Tokenizer:
        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def token_id(self, token):
            return None if token in ("<|channel>", "<channel|>", "<|tool_call>") else self._tok.token_id(token)

    def __init__(self, model):
        self._model = model
        self.tokenizer = self.Tokenizer(model.tokenizer)

    def __getattr__(self, name):
        return getattr(self._model, name)


class ScriptedModel:
    """The model with a `ScriptedEngine` and no vision tower, for a server of its own. It claims an
    audio tower, so that the page offers audio (whose requests the audio test catches in the browser)."""

    def __init__(self, model, script: list[int], delay: float, audio: bool = True):
        self._model = model
        self.engine = ScriptedEngine(model.engine, script, delay)
        self.vision = None
        self.audio = object() if audio else None

    def __getattr__(self, name):
        return getattr(self._model, name)


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory, gl):
    from gemmalite.tools.synth import synth

    return gl.load(synth("tiny", tmp_path_factory.mktemp("tiny-vision"), vision=True, audio=True, progress=False),
                   context=512)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, gl):
    from gemmalite.tools.synth_eg2 import synth_eg2

    return gl.load_embedder(synth_eg2("eg2-tiny", tmp_path_factory.mktemp("eg2"), progress=False))


def _clip_turn(text, clip: bytes):
    return {"role": "user", "content": [{"type": "audio", "audio": clip}, {"type": "text", "text": text}]}


def _turn(text, pic=None):
    return {"role": "user", "content": text if pic is None else [{"type": "image", "image": PICS[pic]},
                                                                  {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def refs(model):
    """`ChatSession.chat` (greedy) of every conversation the tests type, before any serving."""
    def chat(msgs, n):
        return model.session().chat(msgs, max_new_tokens=n, temperature=0)

    out = {"first": chat([{"role": "system", "content": SYSTEM}, _turn(FIRST)], 12)}
    out["second"] = chat([{"role": "system", "content": SYSTEM}, _turn(FIRST),
                          {"role": "assistant", "content": out["first"]}, _turn(SECOND)], 12)
    for pic in PICS:
        out[pic] = chat([_turn(QUESTION, pic)], 8)
    if importlib.util.find_spec("soundfile") is not None:
        out["clip"] = chat([_clip_turn(HEARD, _wav())], 8)
    # the page's tools with tool_choice "required" (the tools grammar: a call first, or with the
    # Think toggle, a thought first: this random model takes that thought and does not end it)
    for key, think in (("tool", False), ("think", True)):
        out[key] = model.session().chat([_turn(WEATHER)], max_new_tokens=40, temperature=0, tools=TOOLS,
                                         tool_choice="required", thinking=think)
    return out


@pytest.fixture(scope="module")
def live(model, embedder, refs):
    from gemmalite.server import build_app

    s = LiveServer(build_app(model, embedder, model_id=MODEL_ID, embedder_id=EMB_ID, api_key=KEY, max_concurrency=4))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def script_ids(model):
    ids = [int(i) for i in model.tokenizer.encode(PAYLOAD, add_special_tokens=False)]
    assert model.tokenizer.decode(ids) == PAYLOAD  # the reply the scripted engine spells is the payload
    return ids


@pytest.fixture(scope="module")
def scripted(model, script_ids, refs):
    from gemmalite.server import build_app

    s = LiveServer(build_app(ScriptedModel(model, script_ids, delay=0.03), model_id="scripted"))
    yield s
    s.stop()


def _agent_script(tok) -> list[int]:
    """A thought, an answer, then a get_weather call, in Gemma 4's markup (special tokens by id)."""
    from gemmalite.chat import ChatTokens

    m = ChatTokens.find(tok)

    def enc(text):
        return [int(i) for i in tok.encode(text, add_special_tokens=False)]

    def q(text):
        return [m.string, *enc(text), m.string]

    return [m.channel, *enc("thought\n" + THOUGHT), m.channel_end, *enc(ANSWER), m.tool_call,
            *enc("call:get_weather{city:"), *q("Paris"), *enc(",unit:"), *q("C"), *enc("}"), m.tool_call_end,
            tok.token_id("<turn|>")]


@pytest.fixture(scope="module")
def agent(model, refs):
    from gemmalite.server import build_app

    s = LiveServer(build_app(ScriptedModel(model, _agent_script(model.tokenizer), delay=0.01, audio=False),
                             model_id="agent"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory, request):
    folder = Path(os.environ.get("GEMMALITE_SCREENSHOTS") or tmp_path_factory.mktemp("ui-screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    yield folder
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\nchat page screenshots: {folder}")


@pytest.fixture(scope="module")
def browser():
    _need_browser()
    from playwright.sync_api import sync_playwright

    # launch() starts the browser on a fresh temporary profile (--user-data-dir) of its own
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield b
        b.close()


class Page:
    """One fresh browser context (its own localStorage) on a server, recording console errors."""

    def __init__(self, browser, server, shots, key=None):
        self.ctx = browser.new_context(viewport={"width": 1200, "height": 800}, permissions=["microphone"])
        self.page = self.ctx.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(f"{m.text} @ {m.location}"))
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.url = f"http://127.0.0.1:{server.port}/"
        self.shots = shots
        if key is not None:
            self.page.add_init_script(f"localStorage.setItem('gemmalite.key', {json.dumps(key)})")
        self.page.goto(self.url)

    def ready(self):
        self.page.wait_for_selector("body[data-ready='1']", timeout=20000)
        return self

    def shot(self, name):
        self.page.screenshot(path=str(self.shots / f"{name}.png"), full_page=True)

    def settings(self, temperature="0", max_tokens="12", system=""):
        self.page.fill("#temperature", temperature)
        self.page.fill("#max_tokens", max_tokens)
        self.page.fill("#system", system)

    def send(self, text):
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")

    def reply(self, index, timeout=60000):
        sel = f".msg.assistant[data-index='{index}'][data-done='1']"
        node = self.page.wait_for_selector(sel, timeout=timeout)
        return node.eval_on_selector(".content", "e => e.textContent"), node

    def texts(self):
        return self.page.eval_on_selector_all(".msg .content", "es => es.map(e => e.textContent)")

    def bodies(self, path="/v1/chat/completions"):
        """The request bodies the page sends to ``path`` from now on (as they left the browser)."""
        out = []
        self.page.on("request", lambda r: r.url.endswith(path) and out.append(json.loads(r.post_data)))
        return out

    def tools(self, tools, choice="auto", think=True):
        self.page.fill("#tools", json.dumps(tools))
        self.page.select_option("#tool_choice", choice)
        self.page.set_checked("#think", think)

    def close(self):
        self.ctx.close()


@pytest.fixture
def open_page(browser, shots):
    pages = []

    def make(server, key=KEY):
        p = Page(browser, server, shots, key)
        pages.append(p)
        return p

    yield make
    for p in pages:
        p.close()


# -- tests --------------------------------------------------------------------------------------------
def test_page_and_capabilities_are_served(live, scripted, model):
    from gemmalite.server import build_app
    from gemmalite.server.ui import CSP

    status, headers, body = live.raw("GET", "/", key=None)  # the page itself needs no key
    assert status == 200 and headers["content-type"].startswith("text/html") and "/ui/app.js" in body
    assert headers["content-security-policy"] == CSP and headers["x-content-type-options"] == "nosniff"
    for d in ("default-src 'self'", "script-src 'self'", "connect-src 'self'", "object-src 'none'"):
        assert d in CSP
    assert "unsafe-inline" not in CSP and "unsafe-eval" not in CSP and "http" not in CSP and "*" not in CSP
    status, headers, _ = live.raw("GET", "/ui/app.js", key=None)
    assert status == 200 and headers["content-type"].startswith("text/javascript")
    assert live.raw("GET", "/v1/capabilities", key=None)[0] == 401  # the API still needs it
    status, _, caps = live.raw("GET", "/v1/capabilities")
    assert status == 200 and (caps["model"], caps["embedder"], caps["context"]) == (MODEL_ID, EMB_ID, 512)
    assert (caps["vision"], caps["audio"], caps["embeddings"], caps["embedding_images"]) == (True, True, True, True)
    from gemmalite.chat import ChatTokens

    assert ChatTokens.find(model.tokenizer) is not None  # a Gemma 4 vocabulary: the server reads replies apart
    assert caps["thinking"] is caps["tools"] is True
    caps = scripted.raw("GET", "/v1/capabilities")[2]
    assert (caps["vision"], caps["audio"], caps["embeddings"], caps["embedder"]) == (False, True, False, None)
    assert (caps["embedding_images"], caps["thinking"], caps["tools"]) == (False, True, True)
    # a vocabulary without Gemma 4's chat markup (Gemma 3's): replies are plain text, no thinking or tools
    plain = build_app(PlainVocabModel(model), ui=False).state.server
    assert plain.chat_format is False
    caps = json.loads(asyncio.run(plain.capabilities(None)).body)
    assert (caps["thinking"], caps["tools"]) == (False, False)
    paths = {getattr(r, "path", None) for r in build_app(model, ui=False).routes}
    assert "/v1/chat/completions" in paths and not {"/", "/ui/app.js"} & paths
    from gemmalite.cli import build_parser

    assert build_parser().parse_args(["serve", "M"]).ui and not build_parser().parse_args(["serve", "M", "--no-ui"]).ui


def test_key_prompt_under_api_key(live, open_page):
    p = open_page(live, key=None)
    p.page.wait_for_selector("#key-dialog[open]")
    p.shot("01-key-prompt")
    p.page.fill("#key-input", "wrong-key")
    p.page.click("#key-submit")
    p.page.wait_for_selector("#key-error:not([hidden])")
    assert "refused" in p.page.text_content("#key-error")
    p.shot("02-key-refused")
    p.page.fill("#key-input", KEY)
    p.page.click("#key-submit")
    p.ready()
    assert not p.page.is_visible("#key-dialog") and p.page.text_content("#model-name") == MODEL_ID
    assert p.page.evaluate("localStorage.getItem('gemmalite.key')") == KEY
    # the browser logs each refused request; nothing else went wrong
    assert all("401" in e and "/v1/capabilities" in e for e in p.errors), p.errors


def test_chat_streams_the_api_reply(live, refs, open_page):
    p = open_page(live).ready()
    p.shot("03-empty")
    assert p.page.is_visible("#image-label") and p.page.is_visible("#audio-label") and p.page.is_visible("#record")
    assert p.page.is_visible("#think-label") and p.page.is_visible("#tools-box")  # the server reads replies apart
    assert not p.page.is_checked("#think")
    p.settings(system=SYSTEM)
    p.send(FIRST)
    text, node = p.reply(1)
    api = live.client().chat.completions.create(
        model=MODEL_ID, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}],
        temperature=0, top_p=0.95, max_tokens=12)
    assert text == api.choices[0].message.content == refs["first"]
    assert int(node.get_attribute("data-chunks")) > 1  # streamed, not one piece
    p.send(SECOND)
    assert p.reply(3)[0] == refs["second"]  # the conversation so far went with it
    p.shot("04-conversation")
    p.page.reload()  # kept in localStorage
    p.ready()
    assert p.texts() == [FIRST, refs["first"], SECOND, refs["second"]]
    chats = '{endpoint="/v1/chat/completions",status="200"}'
    before = live.metric("gemmalite_requests_total", chats)
    p.page.click("#regenerate")  # the last reply is dropped and asked for again
    assert p.reply(3)[0] == refs["second"] and len(p.texts()) == 4
    assert live.metric("gemmalite_requests_total", chats) == before + 1
    p.page.click("#clear")
    assert p.texts() == [] and p.page.evaluate("localStorage.getItem('gemmalite.chat')") is None
    p.page.reload()
    p.ready()
    assert p.texts() == []
    assert p.errors == []


def _attach_js(kind: str) -> str:
    """Script that pastes or drops a PNG (base64 argument) into the page, as a user would."""
    make = "const b = Uint8Array.from(atob(data), c => c.charCodeAt(0)); const dt = new DataTransfer();" \
           "dt.items.add(new File([b], 'pic.png', {type: 'image/png'}));"
    if kind == "paste":
        return f"data => {{ {make} document.getElementById('input').dispatchEvent(" \
               "new ClipboardEvent('paste', {clipboardData: dt, bubbles: true, cancelable: true})); }"
    return f"data => {{ {make} const v = document.getElementById('chat-view');" \
           "v.dispatchEvent(new DragEvent('dragover', {dataTransfer: dt, bubbles: true, cancelable: true}));" \
           "v.dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true})); }"


def test_picture_reaches_the_model(live, refs, open_page, tmp_path):
    p = open_page(live).ready()
    p.settings(max_tokens="8")
    (tmp_path / "a.png").write_bytes(PICS["a"])
    p.page.set_input_files("#image-input", str(tmp_path / "a.png"))  # the file picker
    p.page.wait_for_selector("#attachments .chip.image")
    p.page.fill("#input", QUESTION)
    p.shot("05-picture-attached")
    p.page.press("#input", "Enter")
    assert p.reply(1)[0] == refs["a"]
    assert p.page.eval_on_selector(".msg.user .thumb", "e => e.src").startswith("data:image/png;base64,")
    p.shot("06-picture-reply")
    for kind, pic in (("paste", "b"), ("drop", "a")):
        p.page.click("#clear")
        p.page.evaluate(_attach_js(kind), base64.b64encode(PICS[pic]).decode())
        p.page.wait_for_selector("#attachments .chip.image")
        p.send(QUESTION)
        assert p.reply(1)[0] == refs[pic], kind
    assert p.errors == []


def test_audio_reaches_the_model(live, refs, model, open_page, tmp_path):
    """An audio file attached (the file picker) and a recording (Chromium's fake microphone, encoded
    to WAV in the page) reach the live model: the replies equal `ChatSession.chat` with those clips."""
    pytest.importorskip("soundfile")
    p = open_page(live).ready()
    p.settings(max_tokens="8")
    (tmp_path / "clip.wav").write_bytes(_wav())
    p.page.set_input_files("#audio-input", str(tmp_path / "clip.wav"))
    p.page.wait_for_selector("#attachments .chip.audio")
    p.send(HEARD)
    assert p.reply(1)[0] == refs["clip"]
    p.page.click("#clear")
    sent = p.bodies()
    p.page.click("#record")
    p.page.wait_for_selector("#record:text('Stop recording')")
    time.sleep(1.0)
    p.page.click("#record")
    p.page.wait_for_selector("#attachments .chip.audio")
    p.send(HEARD)
    text = p.reply(1)[0]
    p.shot("06b-recording-reply")
    [body] = sent
    clip = base64.b64decode(body["messages"][-1]["content"][0]["input_audio"]["data"])
    assert clip[:4] == b"RIFF" and text == model.session().chat([_clip_turn(HEARD, clip)], max_new_tokens=8,
                                                                  temperature=0)  # (the server is idle)
    assert p.errors == []


def test_embeddings_tab_ranks_the_near_duplicate_first(live, embedder, open_page):
    docs = ["Oceans are blue and deep.", "The quick brown fox jumps over the lazy dog!", "Mars is a red planet.",
            "Bread rises with yeast.", "A list of prime numbers: 2, 3, 5, 7, 11."]
    query = "The quick brown fox jumps over the lazy dog"
    vecs = embedder.embed([query] + docs)
    want = (vecs[1:] @ vecs[0]) / (np.linalg.norm(vecs[1:], axis=1) * np.linalg.norm(vecs[0]))
    order = np.argsort(-want)
    assert docs[order[0]] == docs[1]  # the planted near-duplicate is the oracle's first
    p = open_page(live).ready()
    p.page.click("#tab-embed")
    p.page.fill("#embed-docs", "\n".join(docs))
    p.page.fill("#embed-query", query)
    p.page.click("#embed-rank")
    p.page.wait_for_selector("#embed-results li")
    got = p.page.eval_on_selector_all("#embed-results li", "ls => ls.map(l => [l.querySelector('.doc').textContent,"
                                                            " Number(l.dataset.score)])")
    assert [g[0] for g in got] == [docs[k] for k in order]
    np.testing.assert_allclose([g[1] for g in got], want[order], atol=1e-5)
    p.shot("07-embeddings")
    assert p.errors == []


def _drop_js(target: str) -> str:
    """Script that drops PNGs ([name, base64] pairs) on the element ``target``, as a user would."""
    return ("pics => { const dt = new DataTransfer(); for (const [name, data] of pics) {"
            " const b = Uint8Array.from(atob(data), c => c.charCodeAt(0));"
            " dt.items.add(new File([b], name, {type: 'image/png'})); }"
            f" const v = document.getElementById('{target}');"
            " v.dispatchEvent(new DragEvent('dragover', {dataTransfer: dt, bubbles: true, cancelable: true}));"
            " v.dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true})); }")


def test_embeddings_tab_ranks_a_near_duplicate_picture_first(live, embedder, open_page, tmp_path):
    """Pictures picked and dropped beside pasted texts, a query picture: sent to /v1/embeddings as
    image_url parts, ranked as `Embedder.embed` ranks the same inputs, the planted near-duplicate
    (the query picture with a little noise) first."""
    from PIL import Image

    rng = np.random.RandomState(7)
    query = rng.randint(0, 256, (64, 64, 3)).astype(np.int16)
    near = np.clip(query + rng.randint(-12, 13, query.shape), 0, 255)

    def png(a):
        buf = io.BytesIO()
        Image.fromarray(np.asarray(a, np.uint8)).save(buf, "PNG")
        return buf.getvalue()

    texts = ["Oceans are blue and deep.", "A list of prime numbers: 2, 3, 5, 7, 11."]
    picked = {f"other-{k}.png": _png(64, 64, 20 + k) for k in range(3)}  # through the file picker
    dropped = {"near-duplicate.png": png(near), "other-3.png": _png(48, 80, 30)}  # dropped on the tab
    pics = {**picked, **dropped}
    qbytes = png(query)
    # the oracle: the Embedder on what the page sends (a picture: one input of one image part)
    vecs = embedder.embed([[qbytes]] + texts + [[b] for b in pics.values()])
    want = (vecs[1:] @ vecs[0]) / (np.linalg.norm(vecs[1:], axis=1) * np.linalg.norm(vecs[0]))
    names = texts + list(pics)
    order = np.argsort(-want)
    assert names[order[0]] == "near-duplicate.png"  # the planted near-duplicate is the oracle's first

    p = open_page(live).ready()
    p.page.click("#tab-embed")
    assert p.page.is_visible("#embed-image-label") and p.page.is_visible("#embed-query-label")
    p.page.fill("#embed-docs", "\n".join(texts))
    for name, data in picked.items():
        (tmp_path / name).write_bytes(data)
    p.page.set_input_files("#embed-image-input", [str(tmp_path / n) for n in picked])
    p.page.wait_for_selector(f"#embed-attachments .chip:nth-child({len(picked)})")
    p.page.evaluate(_drop_js("embed-view"), [[n, base64.b64encode(b).decode()] for n, b in dropped.items()])
    p.page.wait_for_selector(f"#embed-attachments .chip:nth-child({len(pics)})")
    (tmp_path / "query.png").write_bytes(qbytes)
    p.page.set_input_files("#embed-query-input", str(tmp_path / "query.png"))
    p.page.wait_for_selector("#embed-query-attachment .chip.image")
    sent = p.bodies("/v1/embeddings")
    p.page.click("#embed-rank")
    p.page.wait_for_selector("#embed-results li")
    got = p.page.eval_on_selector_all("#embed-results li", "ls => ls.map(l => [l.querySelector('.doc').textContent,"
                                                            " Number(l.dataset.score), l.dataset.kind || 'text'])")
    assert [g[0] for g in got] == [names[k] for k in order]
    assert [g[2] for g in got] == ["text" if k < len(texts) else "image" for k in order]
    np.testing.assert_allclose([g[1] for g in got], want[order], atol=1e-5)
    [body] = sent  # one request, the pictures as the server documents them (image_url data URLs)
    assert body["input"][1:1 + len(texts)] == texts
    assert [base64.b64decode(x[0]["image_url"]["url"].split(",", 1)[1]) for x in body["input"][len(texts) + 1:]] \
        == list(pics.values())
    assert body["input"][0] == [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                    + base64.b64encode(qbytes).decode()}}]
    p.shot("07b-embeddings-pictures")
    assert p.errors == []


def test_model_markup_shows_as_text(scripted, script_ids, open_page):
    p = open_page(scripted, key=None).ready()
    assert not p.page.is_visible("#image-label") and not p.page.is_visible("#tab-embed")  # what the model cannot take
    assert p.page.is_visible("#audio-label") and p.page.is_visible("#record")
    p.page.evaluate("document.addEventListener('securitypolicyviolation', e => "
                    "(window.__violations = window.__violations || []).push([e.violatedDirective, e.blockedURI]))")
    p.settings(max_tokens=str(len(script_ids)))
    p.send(PAYLOAD)  # the user's own words are model-independent text too
    text, _ = p.reply(1)
    assert text == PAYLOAD and p.texts() == [PAYLOAD, PAYLOAD]
    p.page.reload()  # and again from localStorage
    p.ready()
    p.page.evaluate("document.addEventListener('securitypolicyviolation', e => "
                    "(window.__violations = window.__violations || []).push([e.violatedDirective, e.blockedURI]))")
    assert p.texts() == [PAYLOAD, PAYLOAD]
    p.shot("08-markup-as-text")
    assert p.page.eval_on_selector_all("#messages script, #messages img, #messages b", "es => es.length") == 0
    assert p.page.evaluate("window.__pwned") is None and p.page.title() == "gemmalite"
    assert p.page.evaluate("window.__violations || []") == [] and p.errors == []
    # and the policy is in force: an inline script put into the page does not run
    p.page.evaluate("() => { const s = document.createElement('script'); s.textContent = 'window.__inline = 1';"
                    " document.body.append(s); }")
    p.page.wait_for_function("() => (window.__violations || []).length > 0")
    assert p.page.evaluate("window.__inline") is None
    assert [d.split()[0] for d, uri in p.page.evaluate("window.__violations")] == ["script-src-elem"]
    assert p.page.evaluate("window.__violations")[0][1] == "inline"


def test_stop_halts_the_reply(scripted, script_ids, model, open_page):
    steps = 400  # of 30 ms: ~12 s if never stopped
    full = model.tokenizer.decode((script_ids * steps)[:steps])
    p = open_page(scripted, key=None).ready()
    p.settings(max_tokens=str(steps))
    p.send("Go on")
    p.page.wait_for_function("() => document.querySelector('.msg.assistant .content')?.textContent.length > 10")
    p.shot("09-streaming")
    p.page.click("#stop")
    text, node = p.reply(1, timeout=5000)
    assert full.startswith(text) and 10 < len(text) < len(full) / 2
    assert node.query_selector(".finish").text_content() == "(stopped)"
    assert p.page.is_visible("#send") and not p.page.is_visible("#stop")
    t0 = time.time()
    while scripted.srv.scheduler.active and time.time() - t0 < 5:  # the server let the sequence go
        time.sleep(0.05)
    assert not scripted.srv.scheduler.active
    time.sleep(0.3)
    assert p.reply(1)[0] == text  # nothing more arrived
    p.shot("10-stopped")
    assert p.errors == []


def _shown(node) -> dict:
    """What a reply shows: its thought (and whether folded), its answer, its tool calls, its finish note."""
    d = node.query_selector("details.thinking")
    finish = node.query_selector(".finish")
    return {"reasoning": d.query_selector(".text").text_content() if d else None,
            "folded": d.get_attribute("open") is None if d else None,
            "content": node.query_selector(".content").text_content(),
            "calls": [(c.query_selector(".tool-name").text_content(), c.query_selector(".tool-args").text_content())
                      for c in node.query_selector_all(".tool-call")],
            "finish": finish.text_content() if finish else None}


def _api_reply(server, body, key=KEY) -> dict:
    """The API's reply to the very request the page sent, not streamed."""
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    status, _, got = server.raw("POST", "/v1/chat/completions", body, key=key)
    assert status == 200, got
    return got["choices"][0]


def _check_reply(shown, api, want):
    """The page's reply equals the API's reply to the same request and `ChatSession.chat`'s."""
    assert api["finish_reason"] == want.finish_reason
    assert shown["finish"] == {"tool_calls": "(tool calls)", "length": "(cut at max tokens)", "stop": None}[want.finish_reason]
    assert shown["content"] == (api["message"]["content"] or "") == want.content
    assert shown["reasoning"] == api["message"].get("reasoning_content") == want.reasoning
    calls = api["message"].get("tool_calls") or []
    assert len(shown["calls"]) == len(calls) == len(want.tool_calls)
    for (name, args), c, w in zip(shown["calls"], calls, want.tool_calls):
        assert name.startswith(f"Tool call: {w.name}  (call_") and c["function"]["name"] == w.name
        assert json.loads(args) == json.loads(c["function"]["arguments"]) == json.loads(w.arguments)


def test_tool_call_and_thought_from_the_live_model(live, refs, open_page):
    """The page's tools and Think toggle reach the server, whose tools grammar (tool_choice
    "required") makes the random model call get_weather, or with Think, start a thought: the call
    is shown as a call, the thought folded apart from the (empty) answer, each equal to the API's
    reply to the request the page sent and to `ChatSession.chat` with those tools."""
    tool, think = refs["tool"], refs["think"]
    assert tool.tool_calls and all(c.complete for c in tool.tool_calls) and tool.finish_reason == "tool_calls"
    assert think.reasoning and not think.tool_calls and think.finish_reason == "length"
    p = open_page(live).ready()
    p.settings(max_tokens="40")
    p.tools(TOOLS, "required", think=False)
    sent = p.bodies()
    p.send(WEATHER)
    _, node = p.reply(1)
    assert sent[0]["tools"] == TOOLS and sent[0]["tool_choice"] == "required" and "reasoning_effort" not in sent[0]
    shown = _shown(node)
    _check_reply(shown, _api_reply(live, sent[0]), tool)
    assert shown["reasoning"] is None and node.query_selector("details.thinking") is None
    p.shot("11-tool-call")
    p.page.reload()  # the call is kept with the conversation, and the settings with the page
    p.ready()
    assert _shown(p.page.query_selector(".msg.assistant"))["calls"] == shown["calls"]
    assert json.loads(p.page.input_value("#tools")) == TOOLS and p.page.input_value("#tool_choice") == "required"
    p.page.click("#clear")
    p.page.set_checked("#think", True)
    p.send(WEATHER)
    _, node = p.reply(1)
    assert sent[1]["reasoning_effort"] == "medium"
    shown = _shown(node)
    _check_reply(shown, _api_reply(live, sent[1]), think)
    assert shown["folded"] and node.query_selector("details.thinking .text").is_hidden()  # folded: not shown
    p.shot("12-live-thought-folded")
    assert p.errors == []


def test_thought_and_tool_call_render_apart(agent, open_page):
    """A reply holding a thought, an answer and a call in Gemma 4's markup, read apart by the server
    (its parser, under the tools grammar with thinking): the thought folded apart from the answer,
    the call shown as a call, each equal to the API's reply to the same request and to the parts
    the script spells."""
    p = open_page(agent, key=None).ready()
    assert p.page.is_visible("#think-label") and p.page.is_visible("#tools-box")
    p.settings(max_tokens="120")
    p.tools(TOOLS, "auto", think=True)
    sent = p.bodies()
    p.send(WEATHER)
    _, node = p.reply(1)
    assert int(node.get_attribute("data-chunks")) > 3  # streamed
    [body] = sent
    api = _api_reply(agent, body, key=None)
    shown = _shown(node)
    assert shown["reasoning"] == api["message"]["reasoning_content"] == THOUGHT and shown["folded"]
    assert shown["content"] == api["message"]["content"] == ANSWER
    [(name, args)] = shown["calls"]
    [call] = api["message"]["tool_calls"]
    assert name.startswith("Tool call: get_weather  (call_") and call["function"]["name"] == "get_weather"
    assert json.loads(args) == json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    assert shown["finish"] == "(tool calls)" and api["finish_reason"] == "tool_calls"
    assert node.eval_on_selector_all("b, script, img", "es => es.length") == 0  # the thought's markup is text
    p.shot("13-thought-folded-and-tool-call")
    node.query_selector("details.thinking summary").click()
    assert node.query_selector("details.thinking").get_attribute("open") is not None
    p.shot("14-thought-unfolded")
    assert p.errors == []


def test_wav_encoder_matches_soundfile(scripted, open_page):
    """The page's recorder encodes to 16-bit mono WAV: soundfile reads back the rounded samples."""
    sf = pytest.importorskip("soundfile")
    x = np.concatenate([[-1.5, -1.0, -0.5, 0.0, 0.25, 1.0, 2.0], np.sin(np.arange(500) / 7.0) * 0.8])
    p = open_page(scripted, key=None).ready()
    wav = bytes(p.page.evaluate("xs => Array.from(window.gemmaliteUI.encodeWav(Float32Array.from(xs), 16000))",
                                x.tolist()))
    data, rate = sf.read(io.BytesIO(wav), dtype="int16")
    c = np.clip(x.astype(np.float32).astype(np.float64), -1, 1)
    assert rate == 16000 and data.ndim == 1
    np.testing.assert_array_equal(data, np.floor(np.where(c < 0, c * 32768, c * 32767) + 0.5).astype(np.int16))


def test_audio_file_and_recording_are_sent_as_input_audio(scripted, open_page, tmp_path):
    """An audio file goes as it is, a recording (Chromium's fake microphone) as 16 kHz mono WAV, both
    as OpenAI ``input_audio`` parts. The requests are caught in the browser: audio support in the
    server is not ours to test here."""
    sf = pytest.importorskip("soundfile")
    clip = tmp_path / "clip.wav"
    sf.write(clip, (np.sin(np.arange(8000) / 5.0) * 0.5).astype(np.float32), 16000, subtype="PCM_16")
    bodies = []

    def catch(route):
        bodies.append(json.loads(route.request.post_data))
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=(
            'data: {"choices": [{"index": 0, "delta": {"content": "heard"}, "finish_reason": "stop"}]}\n\n'
            "data: [DONE]\n\n"))

    p = open_page(scripted, key=None).ready()
    p.page.route("**/v1/chat/completions", catch)
    p.page.set_input_files("#audio-input", str(clip))
    p.page.wait_for_selector("#attachments .chip.audio")
    p.send("What is said?")
    assert p.reply(1)[0] == "heard"
    p.page.click("#record")
    p.page.wait_for_selector("#record:text('Stop recording')")
    time.sleep(1.0)
    p.page.click("#record")
    p.page.wait_for_selector("#attachments .chip.audio")
    p.shot("15-recording-attached")
    p.send("And this?")
    assert p.reply(3)[0] == "heard"
    p.shot("16-audio-sent")
    assert len(bodies) == 2 and p.errors == []
    part = bodies[0]["messages"][-1]["content"][0]
    assert part == {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip.read_bytes()).decode(),
                                                           "format": "wav"}}
    part = bodies[1]["messages"][-1]["content"][0]
    assert part["type"] == "input_audio" and part["input_audio"]["format"] == "wav"
    samples, rate = sf.read(io.BytesIO(base64.b64decode(part["input_audio"]["data"])), dtype="float32")
    assert rate == 16000 and samples.ndim == 1 and 0.5 < len(samples) / rate < 5
    assert np.abs(samples).max() > 0.01  # the fake microphone's beep, not silence
    assert bodies[1]["messages"][:2] == [bodies[0]["messages"][0], {"role": "assistant", "content": "heard"}]  # history


def test_page_keeps_to_the_servers_max_tokens(model, open_page):
    """Under `serve --max-tokens 8` the page's first message works (its field said 512): the page
    reads the cap from /v1/capabilities, shows it and asks for no more; the reply is
    `ChatSession.chat`'s with 8 tokens."""
    from gemmalite.server import build_app
    from gemmalite.server.protocol import Limits

    want = model.session().chat([_turn(FIRST)], max_new_tokens=8, temperature=0)
    s = LiveServer(build_app(model, model_id=MODEL_ID, api_key=KEY, limits=Limits(max_tokens=8)))
    try:
        p = open_page(s).ready()
        assert p.page.input_value("#max_tokens") == "8"
        p.page.fill("#temperature", "0")
        sent = p.bodies()
        p.send(FIRST)
        assert p.reply(1)[0] == want
        assert [b["max_tokens"] for b in sent] == [8]
        p.page.fill("#max_tokens", "500")  # typed over the cap: sent as the cap
        p.send(SECOND)
        p.reply(3)
        assert [b["max_tokens"] for b in sent] == [8, 8] and not p.errors, p.errors
    finally:
        s.stop()
