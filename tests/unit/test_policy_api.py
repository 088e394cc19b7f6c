"""The OpenAI-compatible policy API (``unirl_ray.serve.openai_api``) over uvicorn on loopback, spoken to with the
official ``openai`` client: what it serves is what the model generates, streaming gives the same text token by
token, stop strings cut where they begin, and every bad request gets its status and reason. No Ray here; the
Serve deployment and the one-command server are tested end to end in ``tests/ray/test_policy_serve.py``, the vLLM
app of the same builder in ``tests/ray/test_vllm_engine.py``."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time

import openai
import pytest
import torch

import support
from unirl_ray.rewards.judge import DEFAULT_TEMPLATE, llm_judge
from unirl_ray.models.causal_lm import CausalLMBundle, CausalLMConfig, TinyLMConfig
from unirl_ray.serve import resolve_model_source
from unirl_ray.serve.openai_api import ImagePolicy, TextPolicy, create_app, load_policy
from unirl_ray.train.export import INFO_FILE

KEY = "test-key"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy") / "tiny-policy"
    CausalLMBundle.from_config(CausalLMConfig(tiny=TinyLMConfig(seed=4))).save_pretrained(str(path))
    return str(path)


@contextlib.contextmanager
def serving(policy: TextPolicy, api_key: str):
    """``create_app(policy)`` on uvicorn on a free loopback port; yields the port."""
    import uvicorn

    port = support.free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(policy, api_key=api_key), host="127.0.0.1", port=port,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(folder):
    policy = TextPolicy(folder)
    with serving(policy, KEY) as port:
        yield policy, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60), port


def direct(policy: TextPolicy, prompt_ids: list[int], n: int) -> str:
    """The greedy continuation computed here, with the model's own ``generate``."""
    with torch.no_grad():
        out = policy.model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                                    pad_token_id=policy.tokenizer.pad_token_id, eos_token_id=policy.tokenizer.eos_token_id)
    return policy.tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)


def test_serves_what_the_model_generates_streams_it_and_cuts_at_stop_strings(server):
    policy, client, _ = server
    assert [m.id for m in client.models.list().data] == ["tiny-policy"]  # the folder's name

    # greedy: exactly the model's own continuation, chat and plain completions
    ids = policy.chat_prompt_ids(CHAT)
    assert ids == policy.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)["input_ids"]
    want = direct(policy, ids, 12)
    chat = client.chat.completions.create(model="tiny-policy", messages=CHAT, max_tokens=12, temperature=0)
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == 12
    assert chat.usage.total_tokens == len(ids) + 12 and choice.finish_reason == "length"
    text = client.completions.create(model="tiny-policy", prompt="abc", max_tokens=9, temperature=0)
    assert text.choices[0].text == direct(policy, policy.text_prompt_ids("abc"), 9)
    assert text.usage.completion_tokens == 9 and text.choices[0].finish_reason == "length"

    # sampled: a seed reproduces, n gives n choices, streaming gives the same text piece by piece
    def sampled(seed, **kw):
        return client.chat.completions.create(model="tiny-policy", messages=CHAT, max_tokens=10, seed=seed,
                                              temperature=1.0, **kw)

    a, b, c = sampled(7), sampled(7), sampled(8)
    assert a.choices[0].message.content == b.choices[0].message.content != c.choices[0].message.content
    assert len(sampled(7, n=3).choices) == 3
    chunks = list(sampled(7, stream=True))
    pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(pieces) >= 5 and "".join(pieces) == a.choices[0].message.content  # token by token, same text
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"
    streamed = client.completions.create(model="tiny-policy", prompt="abc", max_tokens=9, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == text.choices[0].text

    # stop strings: the text ends where the first one begins, finish_reason "stop", streaming too
    stop = want[4:6]
    cut = want[: want.find(stop)]
    stopped = client.chat.completions.create(model="tiny-policy", messages=CHAT, max_tokens=12, temperature=0,
                                             stop=[stop, "never-there"])
    assert stopped.choices[0].message.content == cut and stopped.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="tiny-policy", messages=CHAT, max_tokens=12, temperature=0,
                                                 stop=stop, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"

    # a consumer that goes away mid-stream (a client disconnecting) stops the generation and frees the model
    pieces = policy.stream(ids, max_tokens=200, temperature=1.0, seed=3)
    assert isinstance(next(pieces), str) and isinstance(next(pieces), str)
    pieces.close()
    assert policy._lock.acquire(timeout=30)
    policy._lock.release()
    assert client.chat.completions.create(model="tiny-policy", messages=CHAT, max_tokens=12,
                                          temperature=0).choices[0].message.content == want


@pytest.mark.parametrize(
    "change, status, says",
    [
        ({"temperature": -1}, 400, "temperature"),
        ({"max_tokens": 10_000}, 400, "context length (256)"),
        ({"n": 2, "stream": True}, 400, "n=1"),
        ({"messages": []}, 400, "messages"),
        ({"stop": [""]}, 400, "stop strings"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
         "image_url"),
        ({"model": "gpt-x"}, 404, "'gpt-x' does not exist here; this server has 'tiny-policy'"),
    ],
)
def test_a_bad_request_gets_its_status_and_the_reason(server, change, status, says):
    _, client, _ = server
    request = {"model": "tiny-policy", "messages": CHAT, "max_tokens": 4, **change}
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(**request)
    assert err.value.status_code == status and says in err.value.message
    assert err.value.body["type"] in ("invalid_request_error",)  # OpenAI's error shape


def test_the_api_key_is_required_when_set(server):
    _, _, port = server
    for key in ("wrong", ""):
        other = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key or "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            other.models.list()
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as err:  # no Authorization header at all
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30)
    assert err.value.code == 401 and json.loads(err.value.read())["error"]["code"] == "invalid_api_key"


def test_sources_an_mlflow_registered_version_and_refuses_what_it_cannot_serve(folder, tmp_path):
    from mlflow import MlflowClient

    from unirl_ray.train.export import ExportInfo, register_exported_model

    export = tmp_path / "export"
    CausalLMBundle.from_config(CausalLMConfig(tiny=TinyLMConfig(seed=4))).save_pretrained(str(export))
    info = ExportInfo(path=str(export), model_path=str(export), adapter_path=None, bundle="CausalLMBundle",
                      trainable_attr="model", lora=False, merged_lora=False, policy_version=3)
    (export / INFO_FILE).write_text(json.dumps(info.to_json()))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("serve"))
    version = register_exported_model(str(export), name="tiny-policy", tracking_uri=uri, run_id=run.info.run_id)
    local = resolve_model_source(f"models:/tiny-policy/{version.version}", tracking_uri=uri,
                                 dst_path=str(tmp_path / "download"))
    served = TextPolicy(local, name="tiny-policy")
    assert served.policy_version == 3
    same = TextPolicy(folder)
    for a, b in zip(served.model.state_dict().values(), same.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)

    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_source(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="could not download 'models:/nope/1'"):
        resolve_model_source("models:/nope/1", tracking_uri=uri)
    (export / INFO_FILE).write_text(json.dumps({**info.to_json(), "bundle": "WanBundle"}))
    with pytest.raises(ValueError, match="holds a WanBundle export; the policy app serves causal LMs"):
        load_policy(str(export))


def test_the_deploy_file_builds_the_serve_app():
    import yaml
    from ray.serve import Application

    from serve_apps.policy_app import app_builder

    with open("serve_apps/policy.yaml") as f:
        config = yaml.safe_load(f)
    assert config["http_options"]["host"] == "127.0.0.1"
    (app,) = config["applications"]
    assert app["import_path"] == "serve_apps.policy_app:app_builder"
    assert isinstance(app_builder({"source": "/some/folder", "num_replicas": "2"}), Application)
    with pytest.raises(ValueError, match="needs a 'source'"):
        app_builder({})


def test_the_llm_judge_scores_through_this_api_on_a_tiny_engine(tmp_path, monkeypatch):
    """``rewards.judge.llm_judge`` pointed at a local tiny engine (this app, as the agentic recipes can): each
    score is the first number in the model's own greedy reply to the judge's message, over ``scale`` and
    clamped to [0, 1], or None where the reply has no number; a wrong model name or key makes every score
    None, never 0."""
    folder = tmp_path / "tiny-judge"  # seed 3: its greedy replies to these messages hold numbers, all but one
    CausalLMBundle.from_config(CausalLMConfig(tiny=TinyLMConfig(seed=3))).save_pretrained(str(folder))
    judge = TextPolicy(str(folder))
    prompts = ["what is 6*7?", "what is 2+2?", "name a colour", "7-3?", "what is 9*9?", "say 5"]
    completions = ["42", "5", "blue", "4", "81", "five"]
    answers = ["42", "4", "red", "4", "81", "5"]
    scale, tokens = 3.0, 24
    want = []
    for prompt, completion, answer in zip(prompts, completions, answers, strict=True):
        message = [{"role": "user", "content": DEFAULT_TEMPLATE.format(prompt=prompt, completion=completion, answer=answer)}]
        number = re.search(r"-?\d+(?:\.\d+)?", direct(judge, judge.chat_prompt_ids(message), tokens))
        want.append(None if number is None else min(1.0, max(0.0, float(number.group()) / scale)))
    # both branches and the clamp are exercised: 2/3, 1.0 (7/3 clamped) and None (no number in the reply)
    assert None in want and 1.0 in want and any(s is not None and 0 < s < 1 for s in want), want

    monkeypatch.setenv("JUDGE_KEY", KEY)
    with serving(judge, KEY) as port:
        url = f"http://127.0.0.1:{port}/v1"
        scores = llm_judge(completions=completions, prompts=prompts, answer=answers, base_url=url,
                           model="tiny-judge", scale=scale, max_tokens=tokens, api_key_env="JUDGE_KEY")
        assert scores == want
        assert llm_judge(completions=completions[:2], prompts=prompts[:2], base_url=url, model="another-model",
                         api_key_env="JUDGE_KEY") == [None, None]  # 404
        monkeypatch.setenv("JUDGE_KEY", "wrong")
        assert llm_judge(completions=completions[:2], prompts=prompts[:2], base_url=url, model="tiny-judge",
                         api_key_env="JUDGE_KEY") == [None, None]  # 401


def test_a_text_to_image_export_answers_images_generations(tmp_path, server):
    """An SD3 export (a diffusers pipeline folder + its export info) behind ``/v1/images/generations``: the
    ``openai`` client's ``images.generate`` gets base64 PNGs of the asked size, exactly the pipeline's own
    images for the request's seed; sizes the model cannot draw, URL responses and text routes are 400s (and an
    image request to a text model too)."""
    import base64
    import io

    from PIL import Image

    from unirl_ray.models.sd3 import SD3Bundle
    from unirl_ray.models.sd3.config import SD3PipelineConfig
    from unirl_ray.train.export import ExportInfo

    export = tmp_path / "tiny-sd3"
    transformer = SD3Bundle.from_config(SD3PipelineConfig()).save_pretrained(str(export))
    info = ExportInfo(path=str(export), model_path=transformer, adapter_path=None, bundle="SD3Bundle",
                      trainable_attr="transformer", lora=False, merged_lora=False, policy_version=7)
    (export / INFO_FILE).write_text(json.dumps(info.to_json()))
    policy = load_policy(str(export))
    assert isinstance(policy, ImagePolicy) and policy.policy_version == 7 and policy.name == "tiny-sd3"
    with pytest.raises(ValueError, match="is a text-to-image pipeline"):
        TextPolicy(str(export))

    def pngs(response):
        return [base64.b64decode(d.b64_json) for d in response.data]

    with serving(policy, KEY) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny-sd3"]
        extra = {"seed": 3, "num_inference_steps": 2}
        first = pngs(client.images.generate(model="tiny-sd3", prompt="a red fox", n=2, size="64x32", extra_body=extra))
        again = pngs(client.images.generate(model="tiny-sd3", prompt="a red fox", n=2, size="64x32", extra_body=extra))
        other = pngs(client.images.generate(model="tiny-sd3", prompt="a red fox", n=1, size="64x32",
                                            extra_body={**extra, "seed": 4}))
        assert len(first) == 2 and first == again and other[0] != first[0] and first[0] != first[1]
        for png in first:
            image = Image.open(io.BytesIO(png))
            assert image.format == "PNG" and image.size == (64, 32) and image.mode == "RGB"
        # exactly what the pipeline itself draws for that seed
        own = policy.pipe("a red fox", num_images_per_prompt=2, width=64, height=32, num_inference_steps=2,
                          generator=torch.Generator().manual_seed(3), output_type="pil").images
        assert [np_pixels(Image.open(io.BytesIO(p))) for p in first] == [np_pixels(i) for i in own]
        default = pngs(client.images.generate(model="tiny-sd3", prompt="a cat", extra_body=extra))
        assert Image.open(io.BytesIO(default[0])).size == policy.default_size

        for kwargs, status, says in ((dict(size="66x64"), 400, "multiple of 4"), (dict(size="big"), 400, "size must look"),
                                     (dict(response_format="url"), 400, "not supported"), (dict(n=0), 400, "n"),
                                     (dict(model="other"), 404, "does not exist")):
            with pytest.raises(openai.APIStatusError) as err:
                client.images.generate(**{"model": "tiny-sd3", "prompt": "x", **kwargs})
            assert err.value.status_code == status and says in err.value.message, (kwargs, err.value.message)
        with pytest.raises(openai.BadRequestError, match="generates images: use /v1/images/generations"):
            client.chat.completions.create(model="tiny-sd3", messages=CHAT)
    _, text_client, _ = server
    with pytest.raises(openai.BadRequestError, match="generates text"):
        text_client.images.generate(model="tiny-policy", prompt="x")


def np_pixels(image):
    return list(image.convert("RGB").getdata())


def test_the_builder_picks_vllm_for_a_local_llm_folder_where_it_is_installed_else_hugging_face(folder, tmp_path,
                                                                                               monkeypatch):
    """``engine="auto"`` serves a local causal-LM folder with vLLM (``ray.serve.llm``) where vLLM is installed, and
    with the Hugging Face replica where it is not, for an MLflow URI (downloaded on the replica) and for a folder
    not on this machine; ``engine="vllm"`` says what it cannot serve and how to install it; bad arguments fail in
    the builder. (The vLLM app itself answers the ``openai`` client in ``tests/ray/test_vllm_engine.py``.)"""
    from unirl_ray.serve import vllm_app
    from unirl_ray.serve.deployment import _vllm_model_path, build_policy_app

    monkeypatch.setattr(vllm_app, "vllm_available", lambda: True)
    assert _vllm_model_path(folder, "auto", None) == (folder, "tiny-policy")
    assert _vllm_model_path(folder, "vllm", None) == (folder, "tiny-policy")
    for source, engine in ((folder, "hf"), ("models:/m/1", "auto"), (str(tmp_path / "elsewhere"), "auto")):
        assert _vllm_model_path(source, engine, None) is None, (source, engine)
    with pytest.raises(ValueError, match="does not exist"):
        _vllm_model_path(str(tmp_path / "elsewhere"), "vllm", None)
    export = tmp_path / "kept-apart"  # an export whose LoRA adapters were kept apart: Hugging Face merges them on load
    (export / "model").mkdir(parents=True)
    CausalLMBundle.from_config(CausalLMConfig(tiny=TinyLMConfig(seed=4))).save_pretrained(str(export / "model"))
    from unirl_ray.train.export import ExportInfo

    info = ExportInfo(path=str(export), model_path=str(export / "model"), adapter_path=str(export / "lora_adapter"),
                      bundle="CausalLMBundle", trainable_attr="model", lora=True, merged_lora=False, policy_version=3)
    (export / INFO_FILE).write_text(json.dumps(info.to_json()))
    assert _vllm_model_path(str(export), "auto", None) is None
    with pytest.raises(ValueError, match="LoRA adapters kept apart: vLLM serves causal LMs with their weights merged"):
        _vllm_model_path(str(export), "vllm", None)

    monkeypatch.setattr(vllm_app, "vllm_available", lambda: False)
    assert _vllm_model_path(folder, "auto", None) is None
    with pytest.raises(ValueError, match=r"engine='vllm' needs vLLM and ray.serve.llm: pip install"):
        build_policy_app(folder, engine="vllm")
    with pytest.raises(ValueError, match="engine must be one of auto, hf, vllm"):
        build_policy_app(folder, engine="trt")
    with pytest.raises(ValueError, match="engine_kwargs are vLLM engine options"):
        build_policy_app(folder, engine="hf", engine_kwargs={"max_model_len": 64})


def test_an_eager_vllm_engine_on_cpu_compiles_nothing():
    """vLLM's CPU backend with ``enforce_eager`` (the default of both vLLM paths) runs its ``torch.compile``d sampler
    helpers eagerly (``TORCHDYNAMO_DISABLE`` in the engine's process: inductor would build C++ in every new engine
    process); a GPU engine, or one asked to compile, keeps its compilation."""
    from unirl_ray.serve.vllm_app import VLLM_ENGINE_KWARGS, engine_env

    assert engine_env(dict(VLLM_ENGINE_KWARGS), on_gpu=False) == {"TORCHDYNAMO_DISABLE": "1"}
    assert engine_env({"enforce_eager": True}, on_gpu=True) == {}
    assert engine_env({"enforce_eager": False}, on_gpu=False) == {}
