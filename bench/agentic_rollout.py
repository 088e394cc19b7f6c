"""Agentic rollout: trajectories per second with the RolloutManager's concurrent tools against a sequential
loop, and the manager's own overhead per turn.

    python bench/agentic_rollout.py                        # tiny LM, a short in-process SFT first, ~2-3 min
    python bench/agentic_rollout.py --model /tmp/tool_lm   # the tiny tool-use SFT export (skips the SFT)
    python bench/agentic_rollout.py --tool-latency 0.2 --trajectories 64 --repeats 5

Both sides run the same real pieces in this process (no Ray): the HF rollout engine's code
(``HFRolloutEngine``, token in / token out, built from the tiny agentic recipe's sections), the tiny
calculator task's ``ToolEnvironment`` and ``TokenTranscript``. The calculator answers at once, so a fixed
``--tool-latency`` (seconds per call, a stand-in for a sandboxed Python run or an MCP round trip) is added
to every call. Sides:

- ``manager``: ``RolloutManager`` as the trainer runs it (trajectories open at once, engine calls of up to
  ``requests_per_call`` contexts, tool calls on a pool of ``--tool-workers`` threads);
- ``manager_one_tool_worker``: the same with one tool worker (tool calls one after another; what concurrent
  tools add on top of batched engine calls);
- ``sequential``: one trajectory at a time, each turn one engine call, its tool calls inline.

Reported per side (medians over ``--repeats`` runs, the sides interleaved): trajectories/s, turns/s,
seconds in engine calls, and for the manager its overhead per turn: wall time minus the time the engine
was busy (with zero tool latency, so that nothing else runs), over the turns taken.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "recipes" / "agentic" / "tiny" / "calculator_grpo.yaml"
SFT_DATA = ROOT / "unirl_ray" / "assets" / "data" / "arith_tool_sft" / "tool_calls.jsonl"
TASK = ROOT / "unirl_ray" / "assets" / "data" / "arith_tool_task.jsonl"


class TimedEngine:
    """The HF engine's generate, in process, with the time it is busy recorded (the bench's clock)."""

    def __init__(self, engine, cfg):
        self.engine, self.cfg, self.busy, self.calls = engine, cfg, 0.0, 0
        self.lock = threading.Lock()

    def generate(self, requests):
        with self.lock:  # one replica: calls take turns, as on a Serve replica
            t0 = time.perf_counter()
            out = self.engine._generate(requests, self.engine.version)  # noqa: SLF001 - the replica's body
            self.busy += time.perf_counter() - t0
            self.calls += 1
        return out


class Delayed:
    """A tool answered after ``latency`` seconds (a sandbox run, an MCP round trip)."""

    def __init__(self, tool, latency):
        self.tool, self.latency = tool, latency
        self.name, self.description, self.parameters = tool.name, tool.description, tool.parameters

    def __call__(self, **arguments):
        time.sleep(self.latency)
        return self.tool(**arguments)


def build_engine(model_path, sft_steps):
    import torch
    from omegaconf import OmegaConf

    from unirl_ray.config.recipe import load_recipe
    from unirl_ray.rollout.engines.hf import HFRolloutEngine
    from unirl_ray.rollout.weight_sync import state_checksum

    recipe = load_recipe(str(RECIPE), [f"bundle.config.pretrained_model_path={model_path}" if model_path else
                                       "bundle.config.pretrained_model_path=null"])
    sections = {"bundle": OmegaConf.to_container(recipe.bundle, resolve=True),
                "pipeline": OmegaConf.to_container(recipe.pipeline, resolve=True), "trainable_attr": "model"}
    engine = HFRolloutEngine(sections, store=None, seed=0)
    if model_path is None:
        sft(engine.bundle, sft_steps)
    state = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
    engine.load_weights(0, state, state_checksum(state))
    return engine, recipe, torch


def sft(bundle, steps):
    """A short supervised pass over the shipped tool-use transcripts, so that the policy calls the tool."""
    import torch

    from unirl_ray.agentic import TokenTranscript

    tok, model = bundle.tokenizer, bundle.model
    rows = []
    for line in SFT_DATA.read_text().splitlines():
        messages = json.loads(line)["messages"]
        t = TokenTranscript(tok, messages[:1])
        for m in messages[1:]:
            if m["role"] == "assistant":
                t.add_assistant(tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
            else:
                t.add_observation([m])
        rows.append((t.ids, t.loss_mask))
    model.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = [rows[i] for i in torch.randint(0, len(rows), (16,), generator=gen).tolist()]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width)
        for b, (x, m) in enumerate(batch):
            ids[b, : len(x)], mask[b, : len(m)] = torch.tensor(x), torch.tensor(m, dtype=torch.float32)
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (loss * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().requires_grad_(False)


def requests(n, offset):
    rows = [json.loads(line) for line in TASK.read_text().splitlines()]
    return [{"sample_id": f"b{offset}-{i}", "group_id": f"b{offset}-{i}", "prompt": rows[i % len(rows)]["prompt"],
             "columns": {"answer": rows[i % len(rows)]["answer"]}, "seed": offset * 10_000 + i} for i in range(n)]


def run_manager(engine, env_factory, tokenizer, reqs, tool_workers, context):
    from unirl_ray.rollout.manager import AgentRolloutConfig, RolloutManager

    manager = RolloutManager(engine, make_env=env_factory, tokenizer=tokenizer, max_context_tokens=context,
                             cfg=AgentRolloutConfig(max_in_flight_per_replica=len(reqs), tool_workers=tool_workers,
                                                    strict_check=False))
    try:
        return manager.run(reqs)
    finally:
        manager.shutdown()


def run_sequential(engine, env_factory, tokenizer, reqs, context):
    """One trajectory at a time, tools inline: the loop a script without a manager would write."""
    from unirl_ray.agentic import TokenTranscript

    turns = 0
    for r in reqs:
        env = env_factory()
        transcript = TokenTranscript(tokenizer, env.reset({"prompt": r["prompt"], **r["columns"]}))
        for k in range(64):
            sample = engine.generate([{"sample_id": f"{r['sample_id']}/t{k}", "group_id": r["group_id"],
                                       "prompt": r["prompt"], "prompt_ids": list(transcript.ids),
                                       "seed": r["seed"] * 131 + k}])[0]
            part = sample.parts[0]
            text = transcript.add_assistant(part.completion_ids.tolist(), part.log_probs.tolist())
            turns += 1
            observation, _, done = env.step(text)
            if done:
                break
            transcript.add_observation(observation)
            if len(transcript.ids) > context:
                break
    return turns


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a tool-use causal-LM folder (default: tiny LM + in-process SFT)")
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--tool-latency", type=float, default=0.1, help="seconds added to every tool call")
    parser.add_argument("--tool-workers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    from unirl_ray.agentic import Calculator, ToolEnvironment
    from unirl_ray.rollout.dedicated import DedicatedRollout

    t0 = time.perf_counter()
    engine, recipe, _ = build_engine(args.model, args.sft_steps)
    print(f"engine ready in {time.perf_counter() - t0:.1f}s", flush=True)
    cfg = DedicatedRollout(num_replicas=1, max_ongoing_requests=2, requests_per_call=int(recipe.rollout.requests_per_call))
    tok = engine.pipeline.tokenizer
    context = int(recipe.pipeline.max_prompt_tokens)

    def env_factory(latency):
        return lambda: ToolEnvironment(tools=[Delayed(Calculator(), latency)], max_turns=3, tokenizer=tok,
                                       max_tool_response_tokens=16, tool_timeout_s=30)

    sides = ("manager", "manager_one_tool_worker", "sequential")
    results = {**{side: [] for side in sides}, "overhead_per_turn_s": []}
    for rep in range(args.repeats):
        for side in sides:
            timed = TimedEngine(engine, cfg)
            reqs = requests(args.trajectories, rep)
            t0 = time.perf_counter()
            if side.startswith("manager"):
                workers = args.tool_workers if side == "manager" else 1
                out = run_manager(timed, env_factory(args.tool_latency), tok, reqs, workers, context)
                turns = sum(t.turns for t in out)
                calls = sum(t.env.stats().get("tool_calls", 0) for t in out)
            else:
                turns = run_sequential(timed, env_factory(args.tool_latency), tok, reqs, context)
                calls = None
            wall = time.perf_counter() - t0
            results[side].append({"wall_s": wall, "traj_per_s": len(reqs) / wall, "turns": turns,
                                  "turns_per_s": turns / wall, "engine_busy_s": timed.busy, "engine_calls": timed.calls,
                                  "tool_calls": calls})
            print(f"rep {rep} {side:>23}: {len(reqs) / wall:6.2f} traj/s  {turns / wall:6.2f} turns/s  wall {wall:6.2f}s  "
                  f"engine busy {timed.busy:6.2f}s in {timed.calls} calls", flush=True)
        timed = TimedEngine(engine, cfg)  # zero tool latency: what the manager adds around the engine
        reqs = requests(args.trajectories, 100 + rep)
        t0 = time.perf_counter()
        out = run_manager(timed, env_factory(0.0), tok, reqs, args.tool_workers, context)
        wall = time.perf_counter() - t0
        turns = sum(t.turns for t in out)
        results["overhead_per_turn_s"].append((wall - timed.busy) / max(turns, 1))

    def med(side, key):
        return statistics.median(r[key] for r in results[side])

    ratio = med("manager", "traj_per_s") / med("sequential", "traj_per_s")
    tools_ratio = med("manager", "traj_per_s") / med("manager_one_tool_worker", "traj_per_s")
    print()
    print(f"trajectories/s   manager {med('manager', 'traj_per_s'):.2f}   manager, 1 tool worker "
          f"{med('manager_one_tool_worker', 'traj_per_s'):.2f}   sequential {med('sequential', 'traj_per_s'):.2f}")
    print(f"ratios           manager / sequential {ratio:.2f}x   concurrent / serial tools {tools_ratio:.2f}x   "
          f"(tool latency {args.tool_latency}s, {args.trajectories} trajectories, median of {args.repeats})")
    print(f"engine calls     manager {med('manager', 'engine_calls'):.0f}   sequential {med('sequential', 'engine_calls'):.0f}")
    print(f"manager overhead per turn (no tool latency): {1e3 * statistics.median(results['overhead_per_turn_s']):.2f} ms")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "results": results, "ratio": ratio,
                                                   "tools_ratio": tools_ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
