"""`shunter rollout`, `shunter weights` and `shunter replicas`: a client of the gateway's admin API.

The rollout itself runs inside the cluster (the application's control actor); this command only asks
for it and watches. Killing it at any point changes nothing: run `shunter rollout status MODEL` (or
`start` again, which reports the rollout already under way) to pick it up.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
POLL_S = 2.0


def add_parsers(sub: Any) -> None:
    rollout = sub.add_parser("rollout", help="blue-green rollouts between a model's versions (runs in the cluster)")
    actions = rollout.add_subparsers(dest="action", required=True)

    start = actions.add_parser("start", help="deploy VERSION beside the serving one, shift traffic through "
                               "gated steps, promote or roll back on its own")
    _common(start)
    start.add_argument("--to", required=True, metavar="VERSION", help="a version declared in the model's config")
    start.add_argument("--steps", help="percent on the new version at each step, e.g. 10,50,100 or 100")
    start.add_argument("--hold-s", type=float, help="how long each step holds before its gates are judged")
    start.add_argument("--max-hold-s", type=float, help="longest wait for enough traffic to judge a step")
    start.add_argument("--ready-timeout-s", type=float, help="how long the new version has to become ready")
    start.add_argument("--no-follow", action="store_true", help="return once started instead of watching")
    start.set_defaults(func=_start)

    for name, what in (("status", "the model's weights and latest rollout, with its timeline"),
                       ("pause", "hold the weights and the step's clock"), ("resume", "carry a paused rollout on"),
                       ("rollback", "send all traffic back to the old version and remove the new one")):
        action = actions.add_parser(name, help=what)
        _common(action)
        if name == "status":
            action.add_argument("--follow", action="store_true", help="keep watching until the rollout ends")
        action.set_defaults(func=_action)

    weights = sub.add_parser("weights", help="live traffic weights of a model's versions (no restart)")
    wactions = weights.add_subparsers(dest="action", required=True)
    wset = wactions.add_parser("set", help="e.g. `shunter weights set smol v1=90 v2=10`; versions at 0 stop")
    _common(wset)
    wset.add_argument("weights", nargs="+", metavar="VERSION=WEIGHT")
    wset.set_defaults(func=_set_weights)

    replicas = sub.add_parser("replicas", help="a model's replicas; drain one (no new requests, then replaced)")
    ractions = replicas.add_subparsers(dest="action", required=True)
    rlist = ractions.add_parser("list", help="the model's running replicas, cordons and requests in flight")
    _common(rlist)
    rlist.set_defaults(func=_list_replicas)
    drain = ractions.add_parser("drain", help="cordon REPLICA on every gateway; Ray Serve replaces it once idle")
    _common(drain)
    drain.add_argument("replica")
    drain.add_argument("--keep", action="store_true", help="only cordon it: no replacement")
    drain.add_argument("--timeout-s", type=float, help="replace it after this long even if still busy "
                       "(default: the model's draining.timeout_s)")
    drain.add_argument("--force", action="store_true", help="drain even the last routable replica")
    drain.set_defaults(func=_drain)
    release = ractions.add_parser("release", help="undo a drain: the replica takes new requests and stays")
    _common(release)
    release.add_argument("replica")
    release.set_defaults(func=_release)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model")
    parser.add_argument("--url", default=os.environ.get("SHUNTER_URL", DEFAULT_URL),
                        help=f"the gateway (default $SHUNTER_URL or {DEFAULT_URL})")


def _client(url: str) -> Any:
    import httpx

    # With keys configured, /admin needs an admin key; it comes from the environment, never a flag (flags
    # end up in shell history and process lists).
    key = os.environ.get("SHUNTER_ADMIN_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=url.rstrip("/"), timeout=30, headers=headers)


def _call(url: str, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    import httpx

    try:
        with _client(url) as http:
            # POST and PUT always carry a JSON body (the gateway takes no other content type).
            resp = http.request(method, path, json=body if body is not None or method in ("GET", "DELETE") else {})
    except httpx.HTTPError as exc:
        raise SystemExit(f"cannot reach the gateway at {url}: {exc}") from None
    try:
        data = resp.json()
    except ValueError:
        raise SystemExit(f"{method} {path}: {resp.status_code} {resp.text[:300]}") from None
    if resp.status_code >= 400:
        message = (data.get("error") or {}).get("message", resp.text[:300])
        raise SystemExit(f"{method} {path}: {resp.status_code}: {message}")
    return data


def _start(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"to": args.to}
    if args.steps:
        try:
            body["steps"] = [int(s) for s in args.steps.split(",")]
        except ValueError:
            raise SystemExit(f"--steps {args.steps!r}: give percents separated by commas, e.g. 10,50,100") from None
    for key in ("hold_s", "max_hold_s", "ready_timeout_s"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    status = _call(args.url, "POST", f"/admin/rollouts/{args.model}", body)
    print(f"rollout of {args.model} to {args.to} started; it runs in the cluster (Ctrl-C stops watching only)")
    if args.no_follow:
        _print_status(status)
        return 0
    return _follow(args.url, args.model, status)


def _action(args: argparse.Namespace) -> int:
    if args.action == "status":
        status = _call(args.url, "GET", f"/admin/rollouts/{args.model}")
        if args.follow and status.get("rollout") and status["rollout"]["phase"] != "done":
            return _follow(args.url, args.model, status)
        _print_status(status)
        return 0
    _print_status(_call(args.url, "POST", f"/admin/rollouts/{args.model}/{args.action}"))
    return 0


def _set_weights(args: argparse.Namespace) -> int:
    weights: dict[str, float] = {}
    for item in args.weights:
        version, sep, weight = item.partition("=")
        try:
            weights[version] = float(weight)
        except ValueError:
            sep = ""
        if sep and not math.isfinite(weights[version]):
            raise SystemExit(f"{item!r}: a weight is a finite number, e.g. v1=90")
        if not sep or not version:
            raise SystemExit(f"{item!r}: give VERSION=WEIGHT, e.g. v1=90")
    _print_status(_call(args.url, "PUT", f"/admin/models/{args.model}/weights", {"weights": weights}))
    return 0


def _list_replicas(args: argparse.Namespace) -> int:
    listed = _call(args.url, "GET", f"/admin/models/{args.model}/replicas")["replicas"]
    for r in listed:
        place = "CORDONED" if r["cordoned"] else "standby" if r.get("standby") else "routable"
        print(f"{r['replica']}  version {r['version']}  {place}  "
              f"in flight here {r['in_flight_here']}  breaker {r['breaker']}")
    if not listed:
        print(f"model {args.model}: no running replica")
    return 0


def _drain(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"replace": not args.keep, "force": args.force}
    if args.timeout_s is not None:
        body["timeout_s"] = args.timeout_s
    done = _call(args.url, "POST", f"/admin/models/{args.model}/replicas/{args.replica}/drain", body)
    then = (f"Ray Serve replaces it once idle (at most {done['retire_within_s']:g}s; "
            f"{done['unfinished_requests']} request(s) unfinished now)" if done["replace"] else "it keeps running")
    print(f"replica {done['replica']} of {done['model']} (version {done['version']}) cordoned: {then}")
    return 0


def _release(args: argparse.Namespace) -> int:
    done = _call(args.url, "DELETE", f"/admin/models/{args.model}/replicas/{args.replica}/drain")
    print(f"replica {done['replica']} of {done['model']} released: it takes new requests again")
    return 0


def _follow(url: str, model: str, status: dict[str, Any]) -> int:
    """Print the timeline as it grows; exit 0 once promoted, 1 once rolled back."""
    shown = 0
    try:
        while True:
            rollout = status.get("rollout") or {}
            history = rollout.get("history", [])
            for event in history[shown:]:
                print(event_line(rollout, event), flush=True)
            shown = len(history)
            if rollout.get("phase") == "done":
                print(f"{model}: {rollout['outcome']}; weights {_weights(status)}")
                return 0 if rollout["outcome"] == "promoted" else 1
            time.sleep(POLL_S)
            status = _call(url, "GET", f"/admin/rollouts/{model}")
    except KeyboardInterrupt:
        print(f"\nstopped watching; the rollout goes on in the cluster (`shunter rollout status {model} --follow`)")
        return 130


def _print_status(status: dict[str, Any]) -> None:
    print(f"model {status['model']}: weights {_weights(status)} (from the {status['weights_from']} state); "
          f"running: {', '.join(status['live']) or 'none'}")
    rollout = status.get("rollout")
    if not rollout:
        print("no rollout")
        return
    spec = rollout["spec"]
    state = rollout["phase"] + (" (paused)" if rollout.get("paused_at") else "")
    outcome = f", {rollout['outcome']}" if rollout.get("outcome") else ""
    print(f"rollout {spec['old']} -> {spec['new']}: {state}{outcome}; steps {spec['steps']}, hold {spec['hold_s']:g}s")
    for event in rollout["history"]:
        print(event_line(rollout, event))


def event_line(rollout: dict[str, Any], event: dict[str, Any]) -> str:
    offset = event["at"] - rollout["history"][0]["at"]  # started_at moves on resume; the first event does not
    gates = event.get("gates")
    shown = ""
    if gates:
        shown = " [" + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in gates.items() if v is not None) + "]"
    return f"  +{offset:7.1f}s  {event['phase']:12} {event['weights']}  {event['reason']}{shown}"


def _weights(status: dict[str, Any]) -> str:
    return ", ".join(f"{w['version']}={w['weight']:g}" for w in status["weights"])
