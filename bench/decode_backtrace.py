#!/usr/bin/env python3
"""Decodes the native stacks that SPILLWAY_CRASH_BACKTRACE prints (torch_plugin/crash_backtrace.hpp).

A frame of a library built with hidden symbols (spillway's _C module) prints as an offset only:
    /path/_C.cpython-312-x86_64-linux-gnu.so(+0x5022b)[0x7f74ed08c22b]
This finds every such frame in the given files (text, or JSON whose strings hold stderr tails),
asks addr2line for the function, file and line of each offset in a library that exists here, and
prints each crash's stack again with them. Frames of other libraries are printed as they are.

    bench/decode_backtrace.py torch_gpu_checks.json train_bench.json > crash_stacks.txt

Exit status 0, also when nothing was found (it says so) or addr2line is missing (frames stay raw).
"""

import json
import os
import re
import shutil
import subprocess
import sys

FRAME = re.compile(r"^(?P<path>/[^\s()]+)\((?P<symbol>[^)+]*)\+0x(?P<offset>[0-9a-f]+)\)\[0x[0-9a-f]+\]$")
HEADER = "spillway: fatal signal"


def texts(path):
    """Every text in a file: its strings when it is JSON, else the file itself."""
    with open(path, encoding="utf-8", errors="replace") as f:
        raw = f.read()
    try:
        data = json.loads(raw)
    except ValueError:
        return [raw]
    found = []

    def walk(v):
        if isinstance(v, str):
            found.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
    walk(data)
    return found


def stacks(text):
    """The crash stacks in a text: lists of lines, from the header to the last frame."""
    out, current = [], None
    for line in text.splitlines():
        if line.startswith(HEADER):
            current = [line]
            out.append(current)
        elif current is not None and FRAME.match(line.strip()):
            current.append(line.strip())
        elif current is not None and len(current) > 1:
            current = None
    return out


def decode(path, offsets, addr2line):
    """{offset: "function at file:line"} for the offsets of one library, by addr2line."""
    if addr2line is None or not os.path.exists(path) or not offsets:
        return {}
    try:
        p = subprocess.run([addr2line, "-Cfe", path] + [hex(o) for o in offsets],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    lines = p.stdout.splitlines()
    result = {}
    for i, o in enumerate(offsets):
        if 2 * i + 1 < len(lines):
            function, place = lines[2 * i], lines[2 * i + 1]
            if function != "??" or not place.startswith("??"):
                result[o] = f"{function} at {place}"
    return result


def main(argv):
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: decode_backtrace.py FILE...", file=sys.stderr)
        return 2
    addr2line = shutil.which("addr2line")
    found = []
    for path in argv[1:]:
        if os.path.exists(path):
            for text in texts(path):
                found += [(path, s) for s in stacks(text)]
    if not found:
        print("decode_backtrace: no crash stack in " + ", ".join(argv[1:]))
        return 0
    if addr2line is None:
        print("decode_backtrace: addr2line not found; frames are printed as they are")
    wanted = {}
    for _, stack in found:
        for line in stack[1:]:
            m = FRAME.match(line)
            if not m.group("symbol"):
                wanted.setdefault(m.group("path"), set()).add(int(m.group("offset"), 16))
    names = {lib: decode(lib, sorted(offs), addr2line) for lib, offs in wanted.items()}
    for source, stack in found:
        print(f"== {source}: {stack[0]}")
        for line in stack[1:]:
            m = FRAME.match(line)
            name = None
            if not m.group("symbol"):
                name = names.get(m.group("path"), {}).get(int(m.group("offset"), 16))
            print(f"  {line}" + (f"\n      -> {name}" if name else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
