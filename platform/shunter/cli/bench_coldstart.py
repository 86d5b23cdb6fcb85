"""`shunter bench coldstart`: how long a model replica takes from "Serve starts it" to "it answers", phase
by phase, with the engine's processes forked from the node's server (shunter.engine_forkserver) and
spawned as vLLM starts them (`engine.process_start`), in one run on the same machine.

Per start path, one local cluster, one model, these starts in order:

- `first deploy`: the app deployed on a fresh cluster (the node's fork server, if any, starts with it);
- `engine core killed`: SIGKILL to the replica's engine core; vLLM's monitor sees it, the health check
  fails, Serve replaces the replica;
- `replica killed`: SIGKILL to the replica's process; Serve replaces it;
- `from zero`: the model redeployed with `autoscaling.min_replicas: 0` and let go idle to zero replicas,
  then one streamed chat: its time to first token.

Then, with a warm standby replica (`standby_replicas: 1`, shunter.ops.standby; forked replicas):

- `from zero, standby`: min_replicas 0 and one standby, idle; one streamed chat: its time to first token;
- `replica killed, standby`: one serving replica and one standby; SIGKILL to the serving one, then one
  streamed chat.

No replica starts for those two: their rows have no phases, only the time to answer.

Each row: seconds from the ask (deploy, kill, request) to the model answering again; Serve's part (the
controller noticing and placing the replica until its process started); each phase the replica timed
itself (shunter.engine.START_PHASES, the same figures as the `shunter_replica_start_seconds` histogram
and the `replica.start` span); and the router's part (replica ready until the gateway answered through it).

    shunter bench coldstart [--paths fork-server,spawn] [--model smollm2-135m-instruct] [--no-standby]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from shunter.cli.app_files import generate_model_of
from shunter.engine import START_PHASES

PATHS = ("fork-server", "spawn")
QUESTION = "What is the capital of France? Answer in one word."


def _ready_entry(base_url: str, model: str) -> dict[str, Any] | None:
    import httpx

    try:
        resp = httpx.get(f"{base_url}/ready", timeout=10)
    except httpx.HTTPError:
        return None
    entry = resp.json().get("models", {}).get(model) if resp.status_code == 200 else None
    return entry if entry and entry.get("ready") and entry.get("start") else None


def _answer(base_url: str, model: str, timeout_s: float = 600) -> float:
    """Streams one chat; the time its first token arrived (time.time())."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=timeout_s) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"chat answered {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.time()
    raise RuntimeError("the stream ended without a token")


def _new_replica(base_url: str, model: str, old: str | None, timeout_s: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        entry = _ready_entry(base_url, model)
        if entry is not None and entry["replica"] != old:
            return entry
        time.sleep(0.1)
    raise RuntimeError(f"no new replica of {model} within {timeout_s:g} s")


def _row(scenario: str, path: str, asked: float, answered: float, entry: dict[str, Any]) -> dict[str, Any]:
    start = entry["start"]
    row = {"scenario": scenario, "path": path, "seconds": answered - asked,
           "serve": start["process_started_at"] - asked, "phases": start["phases"],
           "router": answered - start["ready_at"], "replica": entry["replica"]}
    print(f"{scenario} ({path}): {row['seconds']:.1f} s: Serve {row['serve']:.1f}, "
          + ", ".join(f"{k} {v:.1f}" for k, v in row["phases"].items()) + f", router {row['router']:.1f}",
          flush=True)
    return row


def _served(model: Any, path: str, **changes: Any) -> dict[str, Any]:
    engine = {**model.engine.model_dump(), "process_start": path}
    return {**model.model_dump(), "replicas": 1, "autoscaling": None, "cpu_cores_per_replica": "auto",
            "engine": engine, **changes}


def measure_path(config: Path, model_name: str, path: str) -> list[dict[str, Any]]:
    from shunter.config import ShunterConfig
    from shunter.deployments.app import assemble
    from shunter.local_serve import local_serve

    cfg, model, _ = generate_model_of(config, model_name)

    def app(**changes: Any) -> Any:
        return assemble(ShunterConfig.model_validate({**cfg.model_dump(), "models": [_served(model, path, **changes)]}))

    rows = []
    with local_serve() as local:
        url = local.base_url
        asked = time.time()
        local.deploy(app(), "coldstart")
        answered = _answer(url, model.name)
        entry = _new_replica(url, model.name, None)
        rows.append(_row("first deploy", path, asked, answered, entry))
        for scenario, victim in (("engine core killed", lambda e: e["engine_pids"][0]),
                                 ("replica killed", lambda e: e["pid"])):
            asked = time.time()
            os.kill(victim(entry), signal.SIGKILL)
            entry = _new_replica(url, model.name, entry["replica"])
            answered = _answer(url, model.name)
            rows.append(_row(scenario, path, asked, answered, entry))
        # From zero: a model that may scale to zero, left idle until it has.
        zero = {"min_replicas": 0, "max_replicas": 1, "downscale_delay_s": 2, "cold_start_timeout_s": 300}
        local.deploy(app(autoscaling=zero), "coldstart")
        _wait_for_zero(url, model.name)
        asked = time.time()
        answered = _answer(url, model.name)
        rows.append(_row("from zero (first token)", path, asked, answered, _new_replica(url, model.name, None)))
    return rows


def measure_standby(config: Path, model_name: str) -> list[dict[str, Any]]:
    """The two starts a warm standby replica saves: from zero, and a serving replica killed."""
    from shunter.config import ShunterConfig
    from shunter.deployments.app import assemble
    from shunter.local_serve import local_serve

    cfg, model, _ = generate_model_of(config, model_name)
    path = "fork-server + standby"
    served = _served(model, "fork-server", standby_replicas=1,
                     autoscaling={"min_replicas": 0, "max_replicas": 1, "downscale_delay_s": 600})
    rows = []
    with local_serve() as local:
        url = local.base_url
        local.deploy(assemble(ShunterConfig.model_validate({**cfg.model_dump(), "models": [served]})), "coldstart")
        _standing_by(url, model.name, serving=0, standby=1)
        asked = time.time()
        rows.append(_no_start_row("from zero, standby", path, asked, _answer(url, model.name)))
        (serving,) = _standing_by(url, model.name, serving=1, standby=1)
        entry = _ready_entry(url, model.name)  # /ready's probe is routed like a request: to the serving one
        if entry is None or entry["replica"] != serving:
            raise RuntimeError(f"/ready did not reach the serving replica {serving}: {entry}")
        asked = time.time()
        os.kill(entry["pid"], signal.SIGKILL)
        rows.append(_no_start_row("replica killed, standby", path, asked, _answer(url, model.name)))
    return rows


def _standing_by(base_url: str, model: str, serving: int, standby: int, timeout_s: float = 600) -> list[str]:
    """Waits until the gateway routes to `serving` replicas with `standby` warm beside them; returns the
    serving ones."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = httpx.get(f"{base_url}/admin/models/{model}/replicas", timeout=10).json().get("replicas", [])
        named = [r["replica"] for r in rows if not r.get("standby")]
        if len(named) == serving and len(rows) - len(named) == standby:
            return named
        time.sleep(0.25)
    raise RuntimeError(f"{model}: never {serving} serving and {standby} standby replicas in {timeout_s:g} s")


def _no_start_row(scenario: str, path: str, asked: float, answered: float) -> dict[str, Any]:
    row = {"scenario": scenario, "path": path, "seconds": answered - asked, "serve": 0.0, "phases": {},
           "router": answered - asked, "replica": None}
    print(f"{scenario} ({path}): {row['seconds']:.2f} s: no replica started", flush=True)
    return row


def _wait_for_zero(base_url: str, model: str, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        replicas = httpx.get(f"{base_url}/admin/models/{model}/replicas", timeout=10).json().get("replicas")
        if replicas == []:
            time.sleep(3)  # Serve's controller has stopped the process too, not only taken it out of routing
            return
        time.sleep(1)
    raise RuntimeError(f"{model} did not scale to zero within {timeout_s:g} s")


def table(rows: list[dict[str, Any]]) -> str:
    names = list(START_PHASES)
    lines = ["| start | path | seconds to answer | Serve | " + " | ".join(names) + " | router |",
             "|---|---|---|---|" + "---|" * len(names) + "---|"]
    for r in rows:
        if not r["phases"]:  # no replica started (a standby answered)
            lines.append(f"| {r['scenario']} | {r['path']} | **{r['seconds']:.2f}** | - | "
                         + " | ".join("-" for _ in names) + " | - |")
            continue
        phases = " | ".join(f"{r['phases'].get(name, 0.0):.1f}" for name in names)
        lines.append(f"| {r['scenario']} | {r['path']} | **{r['seconds']:.1f}** | {r['serve']:.1f} | {phases} | "
                     f"{r['router']:.1f} |")
    by = {(r["scenario"], r["path"]): r["seconds"] for r in rows}
    ratios = [f"{scenario}: {by[(scenario, 'spawn')] / by[(scenario, 'fork-server')]:.1f}x"
              for scenario in dict.fromkeys(r["scenario"] for r in rows)
              if (scenario, "spawn") in by and (scenario, "fork-server") in by and by[(scenario, "fork-server")]]
    if ratios:
        lines.append("\nspawn / fork-server: " + ", ".join(ratios))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shunter bench coldstart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/local.yaml"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help="engine.process_start values, in the order run (empty: the standby rows alone)")
    parser.add_argument("--out", type=Path, default=Path("results/coldstart.json"))
    parser.add_argument("--no-standby", dest="standby", action="store_false",
                        help="skip the two starts with a warm standby replica")
    args = parser.parse_args(argv)
    from shunter.bench.runner import environment

    rows = []
    for path in filter(None, args.paths.split(",")):  # --paths "": the standby rows alone
        if path not in PATHS:
            parser.error(f"unknown path {path!r}: {', '.join(PATHS)}")
        rows += measure_path(args.config, args.model, path)
    if args.standby:
        rows += measure_standby(args.config, args.model)
    print("\nseconds; phases as each replica timed them (shunter.engine.START_PHASES)\n" + table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "coldstart", "rows": rows, **environment()}, indent=1))
    print(f"\nwritten to {args.out}")
    return 0
