"""The peers `shunter bench` measures Shunter against, each on the same engine settings and cores:
vLLM's own OpenAI server (a subprocess) and Ray Serve LLM 2.60 (`build_openai_app`, deployed on the
benchmark's local Ray cluster; how it runs on CPU: ../shared/notes/ray-serve-llm-cpu.md), and the
chat questions every side of `shunter bench overhead` and `shunter bench saturation` is asked."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from shunter.local_serve import free_port

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in simple words.", "Write a haiku about rain.",
    "Why is the sky blue?", "Give three tips for learning to cook.", "What does a compiler do?",
    "Describe a cat to someone who has never seen one.", "How do airplanes stay in the air?",
]


def vllm_server(model_path: str, served_name: str, engine_cfg: Any) -> tuple[subprocess.Popen, str]:
    """vLLM's own OpenAI server (the reference peers compare against), same settings and cores."""
    import os

    import httpx

    from shunter.cpu_cores import node_cores
    from shunter.engine import EngineSpec, cpu_engine_env

    port = free_port()
    args = EngineSpec(served_name, model_path, "generate", engine_cfg, "cpu").engine_args()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
           "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", args["dtype"], "--max-model-len", str(args["max_model_len"]),
           "--max-num-seqs", str(args["max_num_seqs"]), "--disable-uvicorn-access-log"]
    cmd += ["--enforce-eager"] if args["enforce_eager"] else []
    if args.get("scheduling_policy", "fcfs") != "fcfs":  # engine.scheduling_policy: priority
        cmd += ["--scheduling-policy", args["scheduling_policy"]]
    env = {**os.environ, **cpu_engine_env(engine_cfg.cpu_kv_cache_gib, ",".join(map(str, node_cores())))}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(2)
    proc.kill()
    raise RuntimeError("vLLM's server did not come up within 300 s")


def ray_serve_llm_app(model_path: str, served_name: str, engine_cfg: Any, max_ongoing_requests: int = 64) -> Any:
    """Ray Serve LLM's OpenAI app for the model, with the engine arguments and CPU environment Shunter's
    replica gives the same model (every core of this machine). Its ingress and server take no CPU
    resource: on two cores they would otherwise never be scheduled beside the engine."""
    from ray.serve.llm import LLMConfig, build_openai_app

    from shunter.cpu_cores import node_cores
    from shunter.engine import EngineSpec, cpu_engine_env

    args = EngineSpec(served_name, model_path, "generate", engine_cfg, "cpu").engine_args()
    engine_kwargs = {key: args[key] for key in ("max_model_len", "max_num_seqs", "dtype", "enforce_eager",
                                                 "enable_prefix_caching", "seed") if args.get(key) is not None}
    llm = LLMConfig(
        model_loading_config={"model_id": served_name, "model_source": model_path},
        engine_kwargs=engine_kwargs,
        deployment_config={"num_replicas": 1, "max_ongoing_requests": max_ongoing_requests,
                           "ray_actor_options": {"num_cpus": 0}},
        placement_group_config={"bundles": [{"CPU": 1}]},
        runtime_env={"env_vars": cpu_engine_env(engine_cfg.cpu_kv_cache_gib, ",".join(map(str, node_cores())))},
    )
    return build_openai_app({"llm_configs": [llm], "ingress_deployment_config": {
        "num_replicas": 1, "autoscaling_config": None, "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": 1024}})
