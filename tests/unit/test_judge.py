"""llm_judge against a local OpenAI-style chat endpoint (a stand-in server in this process: the one fake
here); what the judge is sent, how its reply becomes a reward, and that a failed or unparsable reply is an
invalid score, never 0."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from unirl_ray.rewards.judge import llm_judge


@pytest.fixture()
def endpoint():
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers.get("Authorization"), body))
            text = body["messages"][0]["content"]
            if "HANG" in text:
                time.sleep(2.0)
            if "BROKEN" in text:
                self.send_response(500)
                self.end_headers()
                return
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
