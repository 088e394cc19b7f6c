"""The ``ray.serve.llm`` callback of the vLLM policy app (``LLMConfig.callback_config``), in a module of its own:
``ray.serve.llm`` imports it by name in each ``LLMServer`` replica, and it imports ``ray.llm``'s callback base."""

from __future__ import annotations

import os

from ray.llm._internal.common.callbacks.base import CallbackBase


class LocalFolderModel(CallbackBase):
    """Skip ``ray.serve.llm``'s node initialization when there is nothing to fetch: before it starts the engine, an
    ``LLMServer`` runs a Ray task on every node of the engine's placement group to download the model's files
    there (a fresh process that imports vLLM: ~12 s on 2 cores). A model that is a folder this node reads (an
    export) and an engine whose bundles are all on this node need none of it; anything else (a Hugging Face id,
    a remote URI, bundles on other nodes) is initialized as usual."""

    async def on_before_node_init(self) -> None:
        import ray

        source = self.llm_config.model_loading_config.model_source
        if not (isinstance(source, str) and os.path.isdir(source)):
            return
        here = ray.get_runtime_context().get_node_id()
        nodes = set(ray.util.placement_group_table(self.ctx.placement_group)["bundles_to_node_id"].values())
        if nodes == {here}:
            self.ctx.run_init_node = False
