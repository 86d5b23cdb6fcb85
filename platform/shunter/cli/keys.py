"""`shunter keys new|id`: API keys and their public ids."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    keys = sub.add_parser("keys", help="API keys").add_subparsers(dest="action", required=True)
    keys.add_parser("new", help="print a new random API key and its public id").set_defaults(func=_keys_new)
    keys.add_parser("id", help="print the public id (logs, metrics) of the key read from standard input") \
        .set_defaults(func=_keys_id)


def _keys_new(args: argparse.Namespace) -> int:
    from shunter.auth import key_id, new_key

    key = new_key()
    print(key)
    print(f"id: {key_id(key)}  (store the key in a secret; the config names its variable or file)", file=sys.stderr)
    return 0


def _keys_id(args: argparse.Namespace) -> int:
    from shunter.auth import key_id

    key = sys.stdin.read().strip()
    if not key:
        raise SystemExit("give the key on standard input, e.g. `shunter keys id < key-file`")
    print(key_id(key))
    return 0
