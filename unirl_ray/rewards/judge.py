"""An LLM judge over any OpenAI-compatible chat endpoint (vLLM's server, ``ray.serve.llm``, a hosted API).

``llm_judge`` follows the text reward contract (``fn(*, completions, prompts, **columns)``): each completion
is put into ``template`` with its prompt (and the row's ``answer`` where the dataset has one), sent as one
chat message to ``{base_url}/chat/completions`` with temperature 0, and the first number of the reply,
divided by ``scale``, is the reward (clamped to [0, 1]). A request that fails, times out or answers without
a number gives ``None``: the sample is invalid for this step (``reward/invalid_frac``), never scored 0 by
accident. Requests run ``concurrency`` at a time. The API key, when the endpoint needs one, is read from the
environment variable named by ``api_key_env`` in the reward replica (never written into the recipe).

``vlm_judge`` is the same for images (the image reward contract, ``fn(*, images, prompts, **columns)``): the
prompt goes into ``template`` and the image follows it in the same message as a base64 PNG ``image_url``
part (a video ``[F, H, W, 3]``: up to ``max_frames`` frames spread evenly over it, in order), so any
OpenAI-compatible endpoint that serves a vision-language model can score generated images.

Both retry a request that fails (no connection, a 5xx or 429 status, a timeout) ``max_retries`` times after a
short pause; a 4xx answer (the endpoint refused the request as it is) or a reply without a number is not
retried: that sample is invalid.

Standard library only (and Pillow for ``vlm_judge``'s PNGs): it runs in reward replicas without torch or an
OpenAI client.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_TEMPLATE = (
    "You grade answers. Question: {prompt}\nReference answer: {answer}\nAnswer to grade: {completion}\n"
    "Reply with one number from 0 (wrong) to 10 (fully correct) and nothing else."
)
"""The judge's instruction; ``{prompt}``, ``{completion}`` and ``{answer}`` are filled in."""

VLM_TEMPLATE = (
    "You rate generated images. Prompt: {prompt}\nHow well does the image below show the prompt, and how good "
    "is it? Reply with one number from 0 (not at all) to 10 (perfectly) and nothing else."
)
"""``vlm_judge``'s instruction; ``{prompt}`` is filled in, the image follows it."""

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_RETRY_STATUS = {429, 500, 502, 503, 504}


def _headers(api_key_env: str | None, who: str) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise ValueError(f"{who}: api_key_env={api_key_env!r} is not set in the reward replica's environment")
        headers["Authorization"] = f"Bearer {key}"
    return headers


def _ask(url: str, headers: dict[str, str], payload: dict[str, Any], timeout_s: float, max_retries: int) -> str | None:
    """The reply text of one chat completion, or None once the request failed ``1 + max_retries`` times (or
    was refused with a 4xx, or answered in another shape)."""
    body = json.dumps(payload).encode()
    for attempt in range(1 + max(0, max_retries)):
        if attempt:
            time.sleep(min(2.0, 0.2 * attempt))
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - the recipe's endpoint
                reply = json.loads(response.read())["choices"][0]["message"]["content"]
            return reply if isinstance(reply, str) else None
        except urllib.error.HTTPError as exc:
            if exc.code not in _RETRY_STATUS:
                return None
        except (urllib.error.URLError, TimeoutError, OSError):
            continue
        except (KeyError, IndexError, TypeError, ValueError):  # a reply in another shape: asking again will not help
            return None
    return None


def _score(reply: str | None, scale: float) -> float | None:
    found = _NUMBER.search(reply or "")
    if found is None:
        return None
    return min(1.0, max(0.0, float(found.group()) / scale))


def _judge(
    who: str, count: int, content: Callable[[int], Any], *, base_url: str, model: str, scale: float, max_tokens: int,
    timeout_s: float, concurrency: int, api_key_env: str | None, max_retries: int,
) -> list[float | None]:
    """Ask the endpoint about samples ``0 .. count - 1`` (``content(i)``: the user message's content), ``concurrency``
    at a time, greedily; each reply's score, or None."""
    if scale <= 0:
        raise ValueError(f"{who}: scale must be > 0, got {scale}")
    url = base_url.rstrip("/") + "/chat/completions"
    headers = _headers(api_key_env, who)

    def one(i: int) -> float | None:
        payload = {"model": model, "messages": [{"role": "user", "content": content(i)}], "temperature": 0.0,
                   "max_tokens": max_tokens}
        return _score(_ask(url, headers, payload, timeout_s, max_retries), scale)

    if not count:
        return []
    with concurrent.futures.ThreadPoolExecutor(max(1, min(concurrency, count))) as pool:
        return list(pool.map(one, range(count)))


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
    max_retries: int = 1,
    **_: Any,
) -> list[float | None]:
    """One judge score in [0, 1] per completion, or None where the judge gave none (module docstring)."""
    refs = list(answer) if answer is not None else [""] * len(completions)

    def content(i: int) -> str:
        return template.format(prompt=prompts[i], completion=completions[i], answer=refs[i] if refs[i] is not None else "")

    return _judge("llm_judge", len(completions), content, base_url=base_url, model=model, scale=scale,
                  max_tokens=max_tokens, timeout_s=timeout_s, concurrency=concurrency, api_key_env=api_key_env,
                  max_retries=max_retries)


def image_data_urls(image: Any, max_frames: int = 4, index: int | None = None) -> list[str]:
    """``data:image/png;base64,...`` URLs of a uint8 ``[H, W, 3]`` image, or of up to ``max_frames`` frames of a
    ``[F, H, W, 3]`` video spread evenly over it (first and last included), in order (``index``: the sample's
    place in its batch, for the error message)."""
    from PIL import Image

    from unirl_ray.rewards._models import frames_of  # numpy: imported when images are judged

    stack = frames_of(image, index)
    if max_frames < 1:
        raise ValueError(f"vlm_judge: max_frames must be >= 1, got {max_frames}")
    picks = sorted({round(k * (len(stack) - 1) / max(1, max_frames - 1)) for k in range(min(max_frames, len(stack)))})
    urls = []
    for index in picks:
        buffer = io.BytesIO()
        Image.fromarray(stack[index]).save(buffer, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii"))
    return urls


def vlm_judge(
    *,
    images: Sequence[Any],
    prompts: Sequence[str],
    base_url: str,
    model: str,
    template: str = VLM_TEMPLATE,
    scale: float = 10.0,
    max_tokens: int = 8,
    timeout_s: float = 60.0,
    concurrency: int = 8,
    api_key_env: str | None = None,
    max_retries: int = 1,
    max_frames: int = 4,
    **_: Any,
) -> list[float | None]:
    """One judge score in [0, 1] per image (or video), or None where the judge gave none (module docstring)."""
    if images is None or prompts is None or len(images) != len(prompts):
        raise ValueError("vlm_judge needs images=[one per sample] and prompts=[one per sample] (image samples)")
    pictures = [image_data_urls(image, max_frames, i) for i, image in enumerate(images)]  # bad input: before any request

    def content(i: int) -> list[dict[str, Any]]:
        return [{"type": "text", "text": template.format(prompt=prompts[i])},
                *({"type": "image_url", "image_url": {"url": u}} for u in pictures[i])]

    return _judge("vlm_judge", len(images), content, base_url=base_url, model=model, scale=scale,
                  max_tokens=max_tokens, timeout_s=timeout_s, concurrency=concurrency, api_key_env=api_key_env,
                  max_retries=max_retries)
