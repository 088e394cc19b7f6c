"""``python -m unirl_ray.serve SOURCE``: serve a trained model with OpenAI's routes on Ray Serve.

SOURCE is an exported folder (``trainer.export_dir``: a causal LM, or an SD3 text-to-image model served on
``/v1/images/generations``), a Hugging Face model folder, a diffusers pipeline folder, or an MLflow URI
(``models:/<name>/<version>``, ``runs:/<run_id>/<path>``). It starts an embedded Ray (or joins ``--address`` /
``RAY_ADDRESS``), binds Serve's HTTP proxy to ``--host`` (127.0.0.1 by default) and blocks until Ctrl-C or
SIGTERM, then deletes the app. Then, e.g.::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="<name>", messages=[{"role": "user", "content": "hi"}])
    client.images.generate(model="<name>", prompt="a red fox", size="512x512")   # a text-to-image model
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m unirl_ray.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="exported folder, Hugging Face or diffusers folder, or models:/<name>/<version>")
    parser.add_argument("--name", help="the model's name in the API (default: the folder's or registered model's)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("UNIRL_SERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: env UNIRL_SERVE_API_KEY; none: open)")
    parser.add_argument("--num-replicas", type=int, default=1)
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per replica")
    parser.add_argument("--torch-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--engine", default="auto", choices=("auto", "hf", "vllm"),
                        help="what serves an LLM: vllm (ray.serve.llm), hf (Hugging Face generate), or auto (default: "
                             "vllm where it is installed and the source is a local folder it loads, else hf)")
    parser.add_argument("--tracking-uri", default=None, help="MLflow store of a models:/ or runs:/ source")
    parser.add_argument("--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else embedded)")
    parser.add_argument("--app-name", default="policy")
    parser.add_argument("--deploy-timeout-s", type=float, default=600.0,
                        help="give up (and delete the app) when the replicas are not serving after this long")
    args = parser.parse_args(argv)

    from unirl_ray.serve import is_mlflow_uri, resolve_model_source
    from unirl_ray.serve.openai_api import model_folder

    source = args.source
    if not is_mlflow_uri(source):  # a folder that cannot be served fails here, before Ray starts
        try:
            source = model_folder(resolve_model_source(source))[0]
        except ValueError as exc:
            parser.error(str(exc))

    from unirl_ray.runtime.cluster import RayConfig, ensure_ray
    from unirl_ray.runtime.serve import delete_apps, run_app, start_serve
    from unirl_ray.serve.deployment import build_policy_app

    try:  # bad sizes fail here too, before Ray starts
        app = build_policy_app(source, name=args.name, api_key=args.api_key, num_replicas=args.num_replicas,
                               ray_actor_options={"num_cpus": args.num_cpus, "num_gpus": args.num_gpus},
                               torch_dtype=args.torch_dtype, tracking_uri=args.tracking_uri, engine=args.engine)
    except ValueError as exc:
        parser.error(str(exc))
    where = ensure_ray(RayConfig(address=args.address))
    start_serve(http_port=args.port, host=args.host)
    try:
        run_app(app, args.app_name, route_prefix="/", timeout_s=args.deploy_timeout_s)
    except (RuntimeError, TimeoutError) as exc:
        delete_apps([args.app_name])
        print(f"could not serve {args.source}: {exc}", file=sys.stderr, flush=True)
        return 1
    url = f"http://{args.host}:{args.port}/v1"
    print(f"serving {args.source} on {where}: OpenAI API at {url} (GET {url}/models lists the model name); "
          "Ctrl-C stops it", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    delete_apps([args.app_name])
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
