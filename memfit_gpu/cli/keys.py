"""`memfit keys new` / `memfit keys revoke`: the API keys of `memfit serve`, bound to user ids
(memfit_gpu/serve/keys.py).

    memfit keys new --keys FILE --user U [--user U ...] [--name NAME] [--admin]
    memfit keys revoke --keys FILE --name NAME
"""

from __future__ import annotations

import argparse

KEYS_DESCRIPTION = """\
Make an API key for `memfit serve`, bound to the given user ids, and append its SHA-256 to the keys file
(JSON Lines, created when missing). The key is printed once; the file holds only its hash. --admin also
allows the store-wide operations (POST /v1/compact, /v1/consolidate). A running server reads the file again
when it changes: a key made or revoked takes effect at its next request, without a restart."""

REVOKE_DESCRIPTION = """\
Remove the key named NAME from the keys file (the other lines are kept as they are). A running `memfit serve`
reads the file again when it changes and refuses the key (401) from its next request on, without a restart."""


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
    revoke = actions.add_parser("revoke", help="remove a key by its name (a running server refuses it at once)",
                                description=REVOKE_DESCRIPTION)
    revoke.add_argument("--keys", required=True, metavar="FILE", help="keys file (JSON Lines of hashed keys)")
    revoke.add_argument("--name", required=True, help="the key's name (as `memfit keys new --name` gave it)")
    revoke.set_defaults(func=keys_revoke_command)


def keys_new_command(args: argparse.Namespace) -> int:
    from memfit_gpu.serve.keys import new_key

    print(new_key(args.keys, args.user, name=args.name, admin=args.admin))
    return 0


def keys_revoke_command(args: argparse.Namespace) -> int:
    from memfit_gpu.serve.keys import revoke_key

    removed = revoke_key(args.keys, args.name)
    print(f"memfit keys revoke: {args.keys}: key {removed.name!r} (users {', '.join(sorted(removed.users))}) removed")
    return 0
