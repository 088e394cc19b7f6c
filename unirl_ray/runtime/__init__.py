"""The Ray side: joining a cluster (``cluster``), the long-lived Ray Train run (``train_group``; its controller and
worker group where every process inherited Ray Train's settings: ``train_controller``), its command broker
(``broker``), the worker program (``worker``), how a rank object names the commands it serves (``operations``,
Ray-free), the async trainers' policy-version gate (``version_gate``), the Ray Serve start / shutdown-poll settings
the Serve apps share and the lock their builds take (``serve``) and Ray's libraries imported by one driver thread at
a time (``imports``). What a train rank holds and does is the train side's (``unirl_ray.train.rank``), not the
runtime's. Import from the submodules."""
