"""Tools of an MCP server (a real stdio server, tests/unit/mcp_test_server.py, through the official client):
listed with their schemas, called by many trajectories at once; a hung tool and a crashed server each end
their own trajectory with a clear reason while the others finish, and the next call reconnects."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from test_rollout_manager import ScriptedEngine, call, requests  # noqa: E402

from unirl_ray.agentic import MCPServerTools, ToolEnvironment  # noqa: E402
from unirl_ray.agentic.mcp import close_all  # noqa: E402
from unirl_ray.models.causal_lm.tokenizer import build_char_tokenizer  # noqa: E402
from unirl_ray.rollout.manager import AgentRolloutConfig, RolloutManager  # noqa: E402

SERVER = [sys.executable, str(Path(__file__).with_name("mcp_test_server.py"))]


@pytest.fixture()
def server_tools():
    yield lambda **kw: MCPServerTools(command=SERVER, timeout_s=2.0, **kw)
    close_all()


def test_mcp_tools_are_listed_called_and_fail_clearly(server_tools, monkeypatch):
    monkeypatch.setenv("UNIRL_TEST_SECRET", "do-not-leak")
    env = ToolEnvironment(tools=[server_tools(env={"EXTRA": "1"})], tool_timeout_s=5.0)
    names = [t["function"]["name"] for t in env.tools]
    assert names == ["add", "hang", "crash", "env", "fail"]
    add = env.tools[0]["function"]
    assert add["description"] == "Add two integers." and set(add["parameters"]["properties"]) == {"a", "b"}
    obs, _, done = env.step(call("add", a=2, b=40) + call("fail"))
    assert not done and obs[0]["content"] == "42" and obs[1]["content"] == "error: Error executing tool fail"
    assert env.stats()["tool_errors"] == 1
    seen = env.by_name["env"]().split(",")
    assert "EXTRA" in seen and "UNIRL_TEST_SECRET" not in seen  # nothing of the trainer's environment
    with pytest.raises(ValueError, match="no tools \\['nope'\\]"):
        server_tools(include=["nope"]).tools()
    assert [t.name for t in server_tools(include=["add"]).tools()] == ["add"]
    with pytest.raises(ValueError, match="exactly one of"):
        MCPServerTools()


def test_a_hung_mcp_tool_and_a_crashed_server_end_only_their_trajectories(server_tools):
    tok = build_char_tokenizer()

    def script(prompt, context):
        if "<|tool|>" in context:
            return "<answer>" + context.rsplit("<|tool|>", 1)[1].split("<|end|>")[0] + "</answer>"
        return {"hang": call("hang"), "crash": call("crash")}.get(prompt) or call("add", a=int(prompt), b=1)

    # two servers: one answers (add) or hangs, the other (its own process) crashes
    tools = lambda: [server_tools(include=["add", "hang"]), server_tools(include=["crash"], env={"ROLE": "crashy"})]
    manager = RolloutManager(
        ScriptedEngine(tok, script), tokenizer=tok, max_context_tokens=400, cfg=AgentRolloutConfig(tool_workers=8),
        make_env=lambda: ToolEnvironment(tools=tools(), tool_timeout_s=10.0, tokenizer=tok))
    prompts = ["1", "hang", "2", "crash", "3", "4"]
    out = dict(zip(prompts, manager.run(requests(prompts))))
    assert "tool 'hang' timed out: MCP tool 'hang' did not answer within 2s" in out["hang"].failure
    assert "tool 'crash' crashed" in out["crash"].failure and "Connection closed" in out["crash"].failure
    for p in "1234":  # the others finish, with the tool's answer
        assert out[p].failure is None and out[p].answer == str(int(p) + 1)
    # the crashed server is started again for the next call
    again = server_tools(include=["crash"], env={"ROLE": "crashy"})
    assert [t.name for t in again.tools()] == ["crash"]  # listed by a new server process
    manager.shutdown()
