"""The Ray side: joining a cluster (``cluster``), the long-lived Ray Train run (``train_group``), its
command broker (``broker``), the worker program (``worker``) and the Ray Serve start / shutdown-poll
settings the Serve apps share (``serve``). ``stack_worker`` is Ray-free: it is what one train rank
holds, usable in a single process too. Import from the submodules."""
