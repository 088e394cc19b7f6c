"""Exact resume and restart of the AR trainer from its committed checkpoints (DCP shards in the run's storage,
marked by rank 0) on CPU, 2 FSDP2 ranks over gloo, on a simulated multi-node cluster (``ray.cluster_utils.Cluster``: a
head, three nodes with one CPU and one ``train`` resource each, and a ``services`` node for the Serve apps).
The ranks run on two different train nodes (``placement_strategy: STRICT_SPREAD``), the dedicated rollout
engine and the reward app on the services node, the run's own control actors (command broker, weight store) on
the driver's node; the checkpoints are on a path every node reaches (one machine's folder here, shared or cloud
storage on a real cluster).

One straight run serves every test here: GRPO with the dedicated engine to step 6 with a checkpoint every 2
steps, in which the node of rank 1 dies as step 6 starts (its raylet is killed, and its processes with it, as
when a machine goes away). Ray Train restarts the worker group (``ray.max_failures``) on the nodes left (rank 1
on the spare one), the restarted workers load the step-4 checkpoint, the controller rewinds to it, republishes
its weights to the engine and runs steps 5 and 6 again: the same steps, prompts and numbers, one MLflow run, the
restart counted. Its step-2 and step-4 checkpoints were written before the node died, so they are those of an
uninterrupted run. (A SIGKILLed rank is the same restart: the diffusion, SFT, unified and agentic modules test
that one.)

Its storage folder is copied while step 3 trains (``support.copy_run``: the step-2 checkpoint committed,
nothing newer): a fit of the copy resumes after step 2, as a job stopped there would, here with the train ranks
sampling instead of the engine and the rule reward scored in the driver (``trainer.resume_changed_recipe``: the
same weights and seeds give the same samples and scores either way, and no app has to start). Resuming to step 4 must give bit-identical parameters and optimizer state to the straight
run: every random choice is derived from (seed, step, index), the DCP checkpoint holds model, optimizer,
scheduler, EMA and per-rank RNG state, and the controller state holds the data cursor. Resuming the same step-2
checkpoint on ONE worker instead of two (DCP reshards the FSDP2 shards) continues the same run: the mini-batch is
counted over all ranks, so the math is the same, but gloo's two-rank gradient reduction adds in a different
order than one rank does, so the parameters agree to float rounding, not bit for bit.
"""

import json
import os
import shutil
import tempfile
import time

import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from support import attempts, copy_run, fit, load, make, recipe_path

from unirl_ray.train.rank import StackWorker
from unirl_ray.runtime.worker import SHARDS_DIR, STATE_FILE
from unirl_ray.train.configs import TrainTopology
from unirl_ray.trainer.ar import ARTrainer

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.first_lane]  # .ci/test: after the shared-Ray modules

RECIPE = recipe_path("ar", "tiny", "char_grpo_direct.yaml")
ENGINE = recipe_path("ar", "tiny", "char_grpo_engine.yaml")  # the straight run's: a dedicated engine app
SECTIONS = ("bundle", "pipeline", "backend", "algorithm", "stack")
COMMON = ("trainer.checkpoint_every=2", "tracking.log_samples_every=0", "ray.scaling.num_workers=2",
          "ray.scaling.resources_per_worker={CPU: 1, train: 1}", "+ray.scaling.placement_strategy=STRICT_SPREAD")
# the straight run's apps, on the services node: the dedicated engine and the reward app
SERVICES = ("rollout.ray_actor_options={num_cpus: 0.25, resources: {services: 0.01}}", "++reward.placement=serve",
            "reward.ray_actor_options={num_cpus: 0.25, resources: {services: 0.01}}")
# the resumed runs sample on the train ranks and score the rule reward in the driver (no app to start: the same
# samples from the same weights and seeds, the same scores)
SWITCHED = "+trainer.resume_changed_recipe=true"
TRAIN_NODES = 3  # two ranks and a spare for the restart
STEPS = 6


def trained_state(storage, name, step):
    """Parameters and AdamW state of the run's checkpoint at ``step``, loaded in this process."""
    cfg = load(RECIPE, storage, name, f"trainer.num_steps={step}")
    directory = os.path.join(storage, name, f"checkpoint_{step:06d}")
    with open(os.path.join(directory, STATE_FILE)) as f:
        state = json.load(f)
    assert state["step"] == step
    sections = {n: OmegaConf.to_container(cfg[n], resolve=True) for n in SECTIONS}
    worker = StackWorker(sections, topology=TrainTopology(), device=torch.device("cpu"))
    worker.load(os.path.join(directory, SHARDS_DIR), state["backend"])
    backend = worker.backend
    params = {k: v.detach().clone() for k, v in backend.module.state_dict().items()}
    moments = [t.clone() for s in backend.optimizer.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])]
    return params, moments, state


@pytest.fixture(scope="module")
def cluster():
    """The simulated cluster (see the module docstring); yields ``(cluster, {name: node})``."""
    import ray
    from ray.cluster_utils import Cluster

    # a private temp dir: the head's ray_current_cluster file in Ray's default one would make the other lane's
    # processes that call ray.init() without an address join this cluster
    temp_dir = tempfile.mkdtemp(prefix="raymn_", dir="/tmp")  # short: Ray's unix socket paths must stay short
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "temp_dir": temp_dir})
    try:
        nodes = {f"train{i}": cluster.add_node(num_cpus=1, resources={"train": 1}) for i in range(TRAIN_NODES)}
        nodes["services"] = cluster.add_node(num_cpus=1, resources={"services": 1})
        ray.init(address=cluster.address)
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def actor_nodes(prefix):
    """{actor class: node ids of its live actors} for the classes named ``prefix...`` (from the GCS: this cluster
    has no dashboard for the state API); a Serve replica's class is ``ServeReplica:<app>:<deployment>``, a class
    defined in a function is named without its ``<function>.<locals>.`` qualification."""
    from ray._private import state

    nodes = {}
    for actor in state.actors().values():
        name = actor["ActorClassName"].rsplit(".", 1)[-1]
        if name.startswith(prefix) and actor["State"] == "ALIVE":
            nodes.setdefault(name, []).append(actor["Address"]["NodeID"])
    return nodes


@pytest.fixture(scope="module")
def killed(cluster, tmp_path_factory):
    """The straight run (see the module docstring): (trainer, storage, pids killed, first prompts per step,
    two copies of its storage made while step 3 trained, nodes of the ranks per step and call, the dead node,
    nodes of the Serve replicas and control actors, the cluster, its nodes by name)."""
    cluster, nodes = cluster
    storage, copies = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("copies")
    at_step_2 = (copies / "two_workers", copies / "one_worker")
    trainer = make(ARTrainer, ENGINE, storage, "killed", f"trainer.num_steps={STEPS}", *COMMON, *SERVICES,
                   "++ray.max_failures=1", "++ray.num_checkpoints_to_keep=null", experiment="faults")
    pids, first_draw, placed, dead, service_nodes, original = [], {}, {}, [], {}, trainer.train

    def train(samples, *, seed):
        step, prompts = trainer.prompt_log[-1]
        first_draw.setdefault(step, prompts)
        ranks = trainer.group.call("ping", {})
        placed.setdefault(step, []).append([r["node_id"] for r in ranks])
        if step == 1:  # the Serve replicas, and the run's own control actors (command broker, weight store)
            service_nodes.update(actor_nodes("ServeReplica:killed-"), **actor_nodes("CommandBroker"),
                                 **actor_nodes("WeightStore"))
        if step == 3 and not at_step_2[0].exists():
            for copy in at_step_2:
                copy_run(trainer, copy)
        if step == STEPS and not pids:  # step 6's samples are out: rank 1's node dies before it trains
            trainer.group.wait_committed()  # the step-4 checkpoint is what the restart loads
            node = next(n for n in nodes.values() if n.node_id == ranks[1]["node_id"])
            cluster.remove_node(node, allow_graceful=False)
            dead.append(node.node_id)
            pids.append(ranks[1]["pid"])
            deadline = time.monotonic() + 60
            while psutil.pid_exists(pids[0]):  # its worker ends once it finds its raylet gone (~2 s)
                assert time.monotonic() < deadline, "the dead node's train worker is still running after 60 s"
                time.sleep(0.1)
        return original(samples, seed=seed)

    trainer.train = train
    trainer.fit()
    return trainer, storage, pids, first_draw, at_step_2, placed, dead, service_nodes, cluster, nodes


def test_ranks_apps_and_control_actors_run_on_their_nodes_and_a_dead_node_is_survived(killed):
    trainer, _, pids, first_draw, _, placed, dead, service_nodes, cluster, nodes = killed
    train_nodes = {nodes[f"train{i}"].node_id for i in range(TRAIN_NODES)}
    before, after = placed[STEPS]  # rank nodes as step 6 first started, and when it ran again after the restart
    assert len(set(before)) == 2 and set(before) <= train_nodes  # one rank per train node
    assert all(p == before for s, calls in placed.items() for p in calls if s < STEPS - 1)  # until the node died
    assert dead == [before[1]] and len(set(after)) == 2 and set(after) <= train_nodes - set(dead)  # the spare took over
    assert placed[STEPS - 1][-1] == after  # step 5 ran again on the restarted group
    services, head = nodes["services"].node_id, cluster.head_node.node_id
    assert service_nodes == {"ServeReplica:killed-reward:RewardService": [services],  # both apps' replicas
                             "ServeReplica:killed-rollout:RolloutEngine": [services],
                             "CommandBroker": [head], "WeightStore": [head]}, service_nodes  # the driver's node
    assert pids and trainer.restarts == 1 and trainer.policy_version == STEPS
    assert [s for s, _ in trainer.prompt_log] == list(range(1, STEPS + 1))
    assert dict(trainer.prompt_log) == first_draw  # the data cursor rewound: steps 5, 6 drew the same prompts
    for key in ("reward/mean", "train/loss", "train/grad_norm"):
        values = attempts(trainer, key)
        assert sorted(values) == list(range(1, STEPS + 1)), key
        assert len(values[5]) == 2 and values[5][0] == pytest.approx(values[5][1], rel=1e-6, abs=1e-9), key
        assert all(len(v) == 1 for s, v in values.items() if s != 5), key
    assert attempts(trainer, "fault/worker_group_restarts") == {4: [1.0]}  # rewound to the step-4 checkpoint
    client = MlflowClient(trainer.tracker.tracking_uri)
    exp = client.get_experiment_by_name("faults")
    runs = client.search_runs([exp.experiment_id], "tags.mlflow.runName = 'killed'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"


def test_resume_is_exact_and_reshards_onto_fewer_workers(killed):
    _, straight_dir, _, _, (split_dir, reshard_dir), *_ = killed  # the same step-2 checkpoint; the second on 1 worker
    resumed = fit(ARTrainer, RECIPE, split_dir, "killed", "trainer.num_steps=4", *COMMON, SWITCHED,
                  experiment="e2e-resume")
    assert resumed.prompt_log[0][0] == 3  # resumed after the saved step, in the same MLflow run
    fit(ARTrainer, RECIPE, reshard_dir, "killed", "trainer.num_steps=4", *COMMON, SWITCHED, "ray.scaling.num_workers=1",
        experiment="e2e-resume")

    want_params, want_moments, want_state = trained_state(straight_dir, "killed", 4)
    got_params, got_moments, got_state = trained_state(split_dir, "killed", 4)
    assert want_state["controller"]["data"] == got_state["controller"]["data"]  # same prompts consumed
    changed = trained_state(straight_dir, "killed", 2)[0]
    assert any(not torch.equal(want_params[k], changed[k]) for k in want_params)  # steps 3-4 did train
    for k in want_params:
        assert torch.equal(want_params[k], got_params[k]), k
    for a, b in zip(want_moments, got_moments, strict=True):
        assert torch.equal(a, b)

    reshard_params, _, reshard_state = trained_state(reshard_dir, "killed", 4)
    assert reshard_state["backend"]["world_size"] == 1
    for k in want_params:
        torch.testing.assert_close(reshard_params[k], want_params[k], rtol=1e-4, atol=1e-5, msg=k)
