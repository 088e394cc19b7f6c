"""An LLM judge over any OpenAI-compatible chat endpoint (vLLM's server, ``ray.serve.llm``, a hosted API).

``llm_judge`` follows the text reward contract (``fn(*, completions, prompts, **columns)``): each completion
is put into ``template`` with its prompt (and the row's ``answer`` where the dataset has one), sent as one
chat message to ``{base_url}/chat/completions`` with temperature 0, and the first number of the reply,
divided by ``scale``, is the reward (clamped to [0, 1]). A request that fails, times out or answers without
a number gives ``None``: the sample is invalid for this step (``reward/invalid_frac``), never scored 0 by
accident. Requests run ``concurrency`` at a time. The API key, when the endpoint needs one, is read from the
environment variable named by ``api_key_env`` in the reward replica (never written into the recipe).

Standard library only: it runs in reward replicas without torch or an OpenAI client.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

DEFAULT_TEMPLATE = (
    "You grade answers. Question: {prompt}\nReference answer: {answer}\nAnswer to grade: {completion}\n"
    "Reply with one number from 0 (wrong) to 10 (fully correct) and nothing else."
)
"""The judge's instruction; ``{prompt}``, ``{completion}`` and ``{answer}`` are filled in."""

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def llm_judge(
    *,
    completions: Sequence[str],
    prompts: Sequence[str],
    base_url: str,
    model: str,
    template: str = DEFAULT_TEMPLATE,
    answer: Sequence[Any] | None = None,
    scale: float = 10.0,
    max_tokens: int = 8,
    timeout_s: float = 60.0,
    concurrency: int = 8,
    api_key_env: str | None = None,
    **_: Any,
) -> list[float | None]:
    """One judge score in [0, 1] per completion, or None where the judge gave none (module docstring)."""
    if scale <= 0:
        raise ValueError(f"llm_judge: scale must be > 0, got {scale}")
    url = base_url.rstrip("/") + "/chat/completions"
    headers = {"Content-Type": "application/json"}
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise ValueError(f"llm_judge: api_key_env={api_key_env!r} is not set in the reward replica's environment")
        headers["Authorization"] = f"Bearer {key}"
    refs = list(answer) if answer is not None else [""] * len(completions)

    def one(i: int) -> float | None:
        content = template.format(prompt=prompts[i], completion=completions[i], answer=refs[i] if refs[i] is not None else "")
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                           "temperature": 0.0, "max_tokens": max_tokens}).encode()
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - the recipe's endpoint
                reply = json.loads(response.read())["choices"][0]["message"]["content"]
        except (urllib.error.URLError, TimeoutError, OSError, KeyError, IndexError, TypeError, ValueError):
            return None
        found = _NUMBER.search(reply or "")
        if found is None:
            return None
        return min(1.0, max(0.0, float(found.group()) / scale))

    if not completions:
        return []
    with concurrent.futures.ThreadPoolExecutor(max(1, min(concurrency, len(completions)))) as pool:
        return list(pool.map(one, range(len(completions))))
