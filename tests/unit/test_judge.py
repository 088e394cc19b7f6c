"""llm_judge and vlm_judge against a local OpenAI-style chat endpoint (a stand-in server in this process: the
one fake here); what the judge is sent (for images: the pixels themselves, as PNG data URLs), how its reply
becomes a reward, retries of a failed request, and that a refused, failed or unparsable reply is an invalid
score, never 0."""

import base64
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from unirl_ray.rewards.judge import llm_judge, vlm_judge


def _text(content):
    """The text of a chat message's content: a string, or the text parts of a list."""
    if isinstance(content, str):
        return content
    return " ".join(part["text"] for part in content if part["type"] == "text")


def _pictures(content):
    """The images of a chat message's content, decoded from their PNG data URLs."""
    if isinstance(content, str):
        return []
    prefix = "data:image/png;base64,"
    urls = [part["image_url"]["url"] for part in content if part["type"] == "image_url"]
    assert all(u.startswith(prefix) for u in urls), urls
    return [np.asarray(Image.open(io.BytesIO(base64.b64decode(u[len(prefix):])))) for u in urls]


@pytest.fixture()
def endpoint():
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers.get("Authorization"), body))
            content = body["messages"][0]["content"]
            text, pictures = _text(content), _pictures(content)
            if "HANG" in text:
                time.sleep(2.0)
            tries = sum(1 for _, _, b in seen if _text(b["messages"][0]["content"]) == text)
            status = 500 if "BROKEN" in text else 400 if "REFUSE" in text else 503 if "FLAKY" in text and tries == 1 else 200
            if status != 200:
                self.send_response(status)
                self.end_headers()
                return
            if pictures:  # a vision judge that reads the pixels: 10 x the first picture's mean brightness
                reply = f"{10 * pictures[0].mean() / 255:.4f}"
            else:
                reply = "no idea" if "VAGUE" in text else ("8" if "grade: 42" in text else "score: 2.5 / 10")
            out = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    server.shutdown()


def test_judge_scores_parses_and_marks_failures_invalid(endpoint, monkeypatch):
    url, seen = endpoint
    monkeypatch.setenv("JUDGE_KEY", "s3cret")
    scores = llm_judge(completions=["42", "41", "VAGUE", "BROKEN", "HANG"], prompts=["6*7?"] * 5,
                       answer=["42"] * 5, base_url=url, model="judge", timeout_s=0.5, api_key_env="JUDGE_KEY")
    assert scores == [0.8, pytest.approx(0.25), None, None, None]
    path, auth, body = seen[0]
    assert path == "/v1/chat/completions" and auth == "Bearer s3cret"
    assert body["model"] == "judge" and body["temperature"] == 0.0
    assert "Question: 6*7?" in body["messages"][0]["content"] and "Reference answer: 42" in body["messages"][0]["content"]
    with pytest.raises(ValueError, match="api_key_env='MISSING'"):
        llm_judge(completions=["x"], prompts=["p"], base_url=url, model="m", api_key_env="MISSING")
    assert llm_judge(completions=[], prompts=[], base_url=url, model="m") == []


def test_vlm_judge_sends_the_pixels_and_retries_what_failed_once(endpoint):
    url, seen = endpoint
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(4)]
    video = np.stack([np.full((8, 8, 3), 40 * f, dtype=np.uint8) for f in range(6)])  # frame f has value 40 f
    prompts = ["a red fox", "FLAKY cat", "REFUSE", "a dog", "a clip"]
    scores = vlm_judge(images=[*images, video], prompts=prompts, base_url=url, model="vlm", max_frames=3,
                       timeout_s=5, max_retries=1)
    # the judge read each picture: its reply is 10 x the mean brightness, the reward that / 10
    assert scores[0] == pytest.approx(images[0].mean() / 255, abs=1e-4)
    assert scores[1] == pytest.approx(images[1].mean() / 255, abs=1e-4)  # a 503 first, then answered: retried
    assert scores[2] is None  # refused with a 400: invalid, not retried
    assert scores[3] == pytest.approx(images[3].mean() / 255, abs=1e-4)
    assert scores[4] == pytest.approx(0.0)  # the video's first frame is black
    by_prompt = {}
    for _, _, body in seen:
        by_prompt.setdefault(_text(body["messages"][0]["content"]), []).append(body)
    tries = {k.split("Prompt: ")[1].split("\n")[0]: len(v) for k, v in by_prompt.items()}
    assert tries == {"a red fox": 1, "FLAKY cat": 2, "REFUSE": 1, "a dog": 1, "a clip": 1}, tries
    body = next(v for k, v in by_prompt.items() if "a red fox" in k)[0]
    assert body["model"] == "vlm" and body["temperature"] == 0.0
    assert "Prompt: a red fox" in _text(body["messages"][0]["content"])
    (picture,) = _pictures(body["messages"][0]["content"])
    assert np.array_equal(picture, images[0])  # the PNG round trip is lossless
    clip = next(v for k, v in by_prompt.items() if "a clip" in k)[0]
    frames = _pictures(clip["messages"][0]["content"])
    assert [int(f[0, 0, 0]) for f in frames] == [0, 80, 200]  # 3 of 6 frames, spread over the video, in order

    with pytest.raises(ValueError, match="uint8 image"):
        vlm_judge(images=[np.zeros((4, 4, 3), dtype=np.float32)], prompts=["p"], base_url=url, model="m")
    with pytest.raises(ValueError, match="one per sample"):
        vlm_judge(images=images[:2], prompts=["p"], base_url=url, model="m")
    assert vlm_judge(images=[], prompts=[], base_url=url, model="m") == []
