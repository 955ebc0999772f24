"""The local L3 store's maintenance: ``python -m hicache_io.l3 stats DIR`` (objects and bytes on
disk) and ``python -m hicache_io.l3 scrub DIR`` (reads every object; removes the torn, the
truncated and those whose bytes fail their CRC or their hicache-io trailer). JSON on stdout."""

import argparse
import json
import sys

from .local import default_directory, scrub, stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hicache_io.l3", description="The local L3 store's stats and scrub.")
    p.add_argument("command", choices=["stats", "scrub"])
    p.add_argument("directory", nargs="?", default=default_directory(), help="the store's directory (default: %(default)s)")
    args = p.parse_args(argv)
    out = stats(args.directory) if args.command == "stats" else scrub(args.directory)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
