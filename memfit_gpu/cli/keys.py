"""`memfit keys new`: an API key for `memfit serve`, bound to user ids (memfit_gpu/serve/keys.py).

    memfit keys new --keys FILE --user U [--user U ...] [--name NAME] [--admin]
"""

from __future__ import annotations

import argparse

KEYS_DESCRIPTION = """\
Make an API key for `memfit serve`, bound to the given user ids, and append its SHA-256 to the keys file
(JSON Lines, created when missing). The key is printed once; the file holds only its hash. --admin also
allows the store-wide operations (POST /v1/compact, /v1/consolidate)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("keys", help="make API keys for memfit serve", description=KEYS_DESCRIPTION,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    new = actions.add_parser("new", help="a new key bound to user ids (printed once)", description=KEYS_DESCRIPTION)
    new.add_argument("--keys", required=True, metavar="FILE", help="keys file (JSON Lines of hashed keys)")
    new.add_argument("--user", required=True, action="append", help="a user id the key may touch; repeat for more")
    new.add_argument("--name", help="a label for the key (default key<N>)")
    new.add_argument("--admin", action="store_true", help="may also compact and consolidate the whole store")
    new.set_defaults(func=keys_new_command)


def keys_new_command(args: argparse.Namespace) -> int:
    from memfit_gpu.serve.keys import new_key

    print(new_key(args.keys, args.user, name=args.name, admin=args.admin))
    return 0
