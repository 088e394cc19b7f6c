"""RolloutManager and ToolEnvironment without Ray: a scripted engine (the one fake here) answers each context
with a fixed reply, so every branch of the state machine is driven on purpose; the tools, transcripts, chat
template and tokenizer are the real ones."""

import glob
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass

import pytest

from unirl_ray.agentic import Calculator, PythonSandbox, PythonTool, ToolEnvironment
from unirl_ray.agentic.environment import EnvStep, Environment, extract_tag
from unirl_ray.core.sample import Sample, TextPart, chain_turns
from unirl_ray.models.causal_lm.tokenizer import build_char_tokenizer
from unirl_ray.rollout.manager import AgentRolloutConfig, RolloutManager, agent_metrics

import torch


@dataclass
class Cfg:
    num_replicas: int = 2
    max_ongoing_requests: int = 2
    requests_per_call: int = 2
    timeout_s: float = 30.0


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class ScriptedEngine:
    """``reply(prompt, context_text) -> text``; returns samples like DedicatedEngine.generate (ids + eos)."""

    def __init__(self, tokenizer, reply, version=3):
        self.cfg, self.tok, self.reply, self.version = Cfg(), tokenizer, reply, version
        self.contexts, self.calls, self.in_flight, self.peak = [], 0, 0, 0
        self.lock = threading.Lock()

    def generate(self, requests):
        with self.lock:
            self.calls += 1
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            time.sleep(0.02)
            out = []
            for r in requests:
                assert len(r) and len(requests) <= self.cfg.requests_per_call
                self.contexts.append(list(r["prompt_ids"]))
                text = self.reply(r["prompt"], self.tok.decode(r["prompt_ids"]))
                ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                part = TextPart(prompt_ids=torch.tensor(r["prompt_ids"]), completion_ids=torch.tensor(ids),
                                log_probs=torch.full((len(ids),), -0.5), loss_mask=torch.ones(len(ids)))
                out.append(Sample(sample_id=r["sample_id"], group_id=r["group_id"], prompt=r["prompt"],
                                  parts=[part], policy_version=self.version))
            return out
        finally:
            with self.lock:
                self.in_flight -= 1


class Slow:
    name, description, parameters = "slow", "sleeps", {"type": "object"}
    running = 0
    peak = 0
    lock = threading.Lock()

    def __init__(self, seconds):
        self.seconds = seconds

    def __call__(self, **_):
        cls = type(self)  # each test its own subclass: an abandoned call of another test may still be asleep
        with cls.lock:
            cls.running += 1
            cls.peak = max(cls.peak, cls.running)
        time.sleep(self.seconds)
        with cls.lock:
            cls.running -= 1
        return "slept"


class Crash:
    name, description, parameters = "crash", "raises", {"type": "object"}

    def __call__(self, **_):
        raise OSError("the tool process died")


def script(prompt, context):
    """Per prompt: what the 'model' writes, given how far the conversation is."""
    tool_replies = context.count("<|tool|>")
    if prompt.startswith("add"):
        a, b = prompt.split()[1:]
        if tool_replies == 0:
            return call("calculator", expression=f"{a}+{b}")
        return f"<answer>{context.rsplit('<|tool|>', 1)[1].split('<|end|>')[0]}</answer>"
    if prompt == "malformed":
        return "<tool_call>{not json</tool_call>" if tool_replies == 0 else "<answer>?</answer>"
    if prompt == "hang":
        return call("slow")
    if prompt == "crash":
        return call("crash")
    if prompt == "loop":
        return call("calculator", expression="1+1")  # never answers: max_turns ends it
    if prompt == "nap":
        return call("slow") if tool_replies == 0 else "<answer>done</answer>"
    raise AssertionError(prompt)


def manager(engine, tok, tools, *, max_context_tokens=400, **cfg):
    env = lambda: ToolEnvironment(tools=tools(), max_turns=3, tool_timeout_s=0.5, max_tool_response_tokens=64,
                                  tokenizer=tok)
    return RolloutManager(engine, make_env=env, tokenizer=tok, max_context_tokens=max_context_tokens,
                          cfg=AgentRolloutConfig(**cfg))


def requests(prompts):
    return [{"sample_id": f"s1-{i}", "group_id": f"s1-p{i // 2}", "prompt": p, "columns": {"answer": "x"}, "seed": i}
            for i, p in enumerate(prompts)]


def test_trajectories_run_to_the_end_and_a_hung_or_crashed_tool_fails_only_its_own():
    tok = build_char_tokenizer()
    engine = ScriptedEngine(tok, script)
    m = manager(engine, tok, lambda: [Calculator(), Slow(5.0), Crash()], max_in_flight_per_replica=8)
    prompts = ["add 12 30", "add 7 5", "malformed", "hang", "crash", "loop"]
    t0 = time.monotonic()
    out = m.run(requests(prompts))
    assert time.monotonic() - t0 < 4.0  # the hung tool (5 s) was abandoned at its 0.5 s limit
    by = dict(zip(prompts, out))
    assert [t.request["prompt"] for t in out] == prompts  # request order
    assert by["add 12 30"].answer == "42" and by["add 7 5"].answer == "12"
    assert by["add 12 30"].finish == "answer" and by["add 12 30"].turns == 2
    assert by["malformed"].failure is None and by["malformed"].env.stats()["tool_errors"] == 1
    assert "not valid JSON" in tok.decode(by["malformed"].transcript.ids)  # the error went back to the model
    assert "did not answer within tool_timeout_s=0.5s" in by["hang"].failure
    assert "crashed: OSError: the tool process died" in by["crash"].failure
    assert by["loop"].finish == "max_turns" and by["loop"].turns == 3
    for traj in out:
        assert traj.versions == [3] * traj.turns
        traj.transcript.check()
        sample = traj.to_sample(filler_id=tok.pad_token_id)
        assert all(p.policy_version == 3 for p in sample.parts)
        assert sample.columns["completions"] == traj.answer and sample.columns["answer"] == "x"
        row = chain_turns(sample, sample.parts)
        ids = row.prompt_ids.tolist() + row.completion_ids.tolist()
        assert ids == traj.transcript.ids[: len(ids)]  # what trains is what was sampled, token for token
        expected_mask = [0.0 if traj.failure else float(x) for x in traj.transcript.loss_mask[len(row.prompt_ids):len(ids)]]
        assert row.loss_mask.tolist() == expected_mask
    # every context the engine saw was the transcript so far: never re-rendered
    for traj in out:
        for span in traj.transcript.turns:
            assert traj.transcript.ids[: span.start] in engine.contexts
    metrics = agent_metrics(out)
    assert metrics["agent/failed"] == 2 and metrics["agent/turns_max"] == 3
    assert metrics["agent/finish_max_turns_frac"] == pytest.approx(1 / 6)
    assert metrics["agent/retokenize_mismatch_frac"] == 0.0  # the char template re-renders exactly
    assert 0 < metrics["agent/masked_token_frac"] < 1 and metrics["agent/tool_error_rate"] > 0
    m.quiesce(5.0)
    m.shutdown()


def test_tools_of_many_trajectories_run_at_once_within_the_bounds():
    tok = build_char_tokenizer()
    engine = ScriptedEngine(tok, script)
    class Nap(Slow):
        running, peak, lock = 0, 0, threading.Lock()

    m = manager(engine, tok, lambda: [Nap(0.3)], max_in_flight_per_replica=3, tool_workers=4)
    t0 = time.monotonic()
    out = m.run(requests(["nap"] * 8))
    elapsed = time.monotonic() - t0
    assert all(t.answer == "done" for t in out)
    assert Nap.peak == 4  # the tool pool's bound, reached
    assert m.peak_open <= 6 and m.peak_calls <= 4 and engine.peak <= 4  # 3 per replica x 2; 2 calls per replica
    assert elapsed < 8 * 0.3  # not one after the other
    m.shutdown()


@pytest.mark.skipif(not PythonSandbox.available(), reason="no user namespaces / unshare here")
def test_each_trajectory_has_its_own_python_process_and_it_ends_with_the_trajectory():
    """One PythonTool object in the recipe, several trajectories at once: each keeps its own variables from its
    first call to its second, and when ``run`` returns no sandbox process or scratch directory is left."""

    def remember(prompt, context):
        replies = context.count("<|tool|>")
        if replies == 0:
            return call("python", code=f"x = {prompt.split()[1]}")
        if replies == 1:
            return call("python", code="print(x * 2)")
        return f"<answer>{context.rsplit('<|tool|>', 1)[1].split('<|end|>')[0]}</answer>"

    tok = build_char_tokenizer()
    shared = PythonTool(limits={"wall_s": 20.0})
    sessions = []

    def make_env():
        env = ToolEnvironment(tools=[shared], max_turns=4, tool_timeout_s=30, tokenizer=tok)
        sessions.append(env.by_name["python"]._session)
        return env

    m = RolloutManager(ScriptedEngine(tok, remember), make_env=make_env, tokenizer=tok, max_context_tokens=400,
                       cfg=AgentRolloutConfig(max_in_flight_per_replica=4, tool_workers=4))
    pattern = os.path.join(tempfile.gettempdir(), "unirl-sandbox-*")
    before = set(glob.glob(pattern))
    out = m.run(requests([f"keep {v}" for v in (3, 17, 25, 40)]))
    assert [t.answer for t in out] == ["6", "34", "50", "80"] and all(t.failure is None for t in out)
    assert len(sessions) == 4 and len({id(s) for s in sessions}) == 4
    assert all(s._closed and s._proc is None and s.restarts == 0 for s in sessions)  # closed with the trajectory
    assert set(glob.glob(pattern)) <= before
    m.shutdown()


def test_single_turn_batches_are_in_order_tracked_for_quiesce_and_checked():
    """``generate`` (the ar / diffusion / pe / unified trainers' mode): the engine's samples in request order;
    ``quiesce`` waits while a batch is in flight (and says so past its timeout); a short or reordered answer
    is refused; ``run`` without an environment says what it needs."""
    tok = build_char_tokenizer()
    release = threading.Event()

    class Held(ScriptedEngine):
        def generate(self, requests, min_version=None):
            self.min_version = min_version
            release.wait(10)
            return super().generate(requests)[: self.keep]

    engine = Held(tok, lambda prompt, context: "ok")
    engine.keep = None
    m = RolloutManager(engine)
    reqs = [{**r, "prompt_ids": tok("q", add_special_tokens=False)["input_ids"]} for r in requests(["a", "b"])]
    result = []
    worker = threading.Thread(target=lambda: result.append(m.generate(reqs, min_version=4)))
    worker.start()
    time.sleep(0.2)
    with pytest.raises(TimeoutError, match="still in flight"):
        m.quiesce(0.2)
    release.set()
    m.quiesce(5.0)
    worker.join(5)
    assert [s.sample_id for s in result[0]] == ["s1-0", "s1-1"] and engine.min_version == 4
    engine.keep = 1
    with pytest.raises(RuntimeError, match="out of order or incompletely"):
        m.generate(reqs)
    with pytest.raises(RuntimeError, match="make_env"):
        m.run(reqs)
    with pytest.raises(RuntimeError, match="stream mode"):
        m.take(1)
    assert m.close_stream("nothing ran") is None
    m.shutdown()


def test_a_context_over_the_limit_ends_the_trajectory_and_a_long_prompt_fails_it():
    tok = build_char_tokenizer()
    engine = ScriptedEngine(tok, script)
    m = manager(engine, tok, lambda: [Calculator()], max_context_tokens=90)
    full, = m.run(requests(["loop"]))
    assert full.finish == "context_full" and full.failure is None and full.turns == 1
    m = manager(engine, tok, lambda: [Calculator()], max_context_tokens=5)
    long, = m.run(requests(["add 1 2"]))
    assert "over pipeline.max_prompt_tokens=5" in long.failure and long.turns == 0
    placeholder = long.to_sample(filler_id=0).parts[0]
    assert placeholder.loss_mask.tolist() == [0.0]  # nothing of it trains


def test_tool_environment_contract():
    tok = build_char_tokenizer()
    env = ToolEnvironment(tools=[Calculator()], system_prompt="use tools", max_tool_response_tokens=3,
                          truncate_side="right", tokenizer=tok)
    assert env.reset({"prompt": "2+2?"})[0] == {"role": "system", "content": "use tools"}
    assert env.tools[0]["function"]["name"] == "calculator"
    obs, reward, done = env.step(call("calculator", expression="123456*10"))
    assert not done and reward is None and obs == [{"role": "tool", "name": "calculator", "content": "123"}]
    env.max_tool_response_tokens = 200
    obs, _, _ = env.step(call("nope") + call("calculator", expression="2**1000"))
    assert "unknown tool 'nope'; the tools are: calculator" in obs[0]["content"]
    assert obs[1]["content"] == "error: cannot compute it: exponents above 100 are refused"
    assert env.stats()["tool_errors"] == 2 and env.stats()["tool_calls"] == 3 and env.stats()["tool_truncated"] >= 1
    assert env.step("so <answer> 4 </answer>") == EnvStep([], None, True) and env.answer() == "4"
    assert env.finish_reason == "answer"  # a message without a tool call is the final one
    assert extract_tag("<answer>1</answer> then <answer>2</answer>", "answer") == "2"
    with pytest.raises(ValueError, match="duplicate"):
        ToolEnvironment(tools=[Calculator(), Calculator()])
    with pytest.raises(ValueError, match="truncate_side"):
        ToolEnvironment(truncate_side="middle")
    assert issubclass(ToolEnvironment, Environment)
