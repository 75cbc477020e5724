"""Checks a `make bench-smoke` run by the fields of its JSON lines, not by their text.

    python3 benches/smoke_check.py FILE [--judged RATIO]...

Fails (exit 1, one line per problem on stderr) unless
- each RATIO named is in FILE, judged ("met" true or false) on at least one measured pair;
- no ratio that was not measured ("value" null) says whether it met its target: an unmeasured
  target once read "no".
Lines of FILE that are not JSON objects (cargo's output, the readable table) are skipped.
"""

import argparse
import json
import math
import sys


def ratios(path):
    """The ratio lines of the benchmark's output in `path`, by name."""
    found = {}
    with open(path, encoding="utf-8") as lines:
        for text in lines:
            text = text.strip()
            if not text.startswith("{"):
                continue
            line = json.loads(text)
            if "ratio" in line:
                found[line["ratio"]] = line
    return found


def is_number(value):
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def problems(found, judged):
    """What is wrong with the ratio lines `found`, given the ratios that must be `judged`."""
    wrong = []
    if not found:
        wrong.append("no ratio line at all")
    for name in judged:
        line = found.get(name)
        if line is None:
            wrong.append(f"no line for the ratio {name!r}")
        elif not isinstance(line.get("met"), bool):
            wrong.append(f"{name!r} was not judged: {line}")
        elif not line.get("pairs") or not all(is_number(p) for p in line["pairs"]):
            wrong.append(f"{name!r} has no measured pair: {line}")
    for name, line in found.items():
        if line.get("value") is None and line.get("met") is not None:
            wrong.append(
                f"{name!r} was not measured but says met={line['met']}: {line}"
            )
    return wrong


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--judged", action="append", default=[], metavar="RATIO")
    arguments = parser.parse_args()
    wrong = problems(ratios(arguments.file), arguments.judged)
    for problem in wrong:
        print(f"bench-smoke: {arguments.file}: {problem}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
